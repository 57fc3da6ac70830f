/* db.h - the outbox table over libpq. The db files are the only ones that
 * include libpq: db.c (the handle, blocking use for the sweeper and
 * outboxctl), db_async.c (the same handle driven by the relay's poll loop),
 * db_table.c (the sweeper's statements); db_admin.c and db_migrate.c
 * (outboxctl's, db_admin.h: a library of their own that only outboxctl
 * links). */
#ifndef OUTBOX_DB_H
#define OUTBOX_DB_H

#include <stddef.h>

struct db;

/* One statement a program prepares on every connect: its name (the .sql
 * file's) and its text, which names the table as :table (the quoted
 * identifier) or :'table' (a string literal of it). */
struct db_sql {
        const char *name;
        const char *text;
};

/* ---- the handle (db.c) ---- */

/* Creates an unconnected handle; copies the strings. NULL on allocation
 * failure. `table` must have passed config_check_identifier(). */
struct db *db_new(const char *url, const char *table, const char *relay_id);

/* Connects, blocking until the session is set up (db_async.h's set-up:
 * the SETs of db_async_configure(), the table resolved, its statements
 * prepared), then the sweeper's statements. 0 or -1 (errstr set, no
 * password in it), or DB_ERR_SERVER_VERSION: the server is older than
 * the oldest PostgreSQL major the programs support (deploy/versions'
 * PG_MIN_MAJOR), so connecting again cannot help (errstr names the version). */
#define DB_ERR_SERVER_VERSION (-2)
int db_connect(struct db *db, char *errstr, size_t errstr_size) __attribute__((warn_unused_result));

/* Nonzero while the connection is believed good. */
int db_connected(const struct db *db);

/* Drops the connection (db_connect() may follow). */
void db_disconnect(struct db *db);

/* How many times a connect succeeded: a change tells a caller that the
 * connection was replaced (and what it had sent may have been lost). */
long db_connects(const struct db *db);

/* The server process serving the connection (0 when not connected). */
int db_backend_pid(const struct db *db);

/* The table as resolved at connect ("schema"."name"), NULL before. */
const char *db_table_name(const struct db *db);

/* Closes and frees. NULL is a no-op. */
void db_destroy(struct db *db);

/* ---- table-wide statements (db_table.c) ----
 * Each runs on at most `limit` rows, taken with SKIP LOCKED; *n gets the
 * rows it changed. */

/* Sweeper: moves PUBLISHING rows locked longer than lock_timeout_s ago to
 * FAILED (STALE_LOCK, due now). */
int db_reset_stale(struct db *db, int lock_timeout_s, int max_attempts, int limit, long long *n,
                   long long *dead, char *errstr, size_t errstr_size)
        __attribute__((warn_unused_result));

/* Sweeper: deletes at most `limit` PUBLISHED rows published more than
 * retention_s ago; with `keep_latest`, each aggregate's latest published row
 * stays (parked at available_at 'infinity', out of later scans). *deleted
 * gets the rows deleted, *seen the rows looked at (`limit` when more may be
 * left). */
int db_delete_published(struct db *db, long long retention_s, int limit, int keep_latest,
                        long long *deleted, long long *seen, char *errstr, size_t errstr_size)
        __attribute__((warn_unused_result));

/* Sweeper: parks PENDING/FAILED versions behind a DEAD version of their
 * aggregate out of the lock scan (available_at 'infinity', last_error_code
 * BLOCKED). */
int db_park_blocked(struct db *db, int limit, long long *n, char *errstr, size_t errstr_size)
        __attribute__((warn_unused_result));

/* Sweeper: makes parked versions due again once no DEAD version of their
 * aggregate is below them (every parked version with `all`). */
int db_unpark_blocked(struct db *db, int all, int limit, long long *n, char *errstr,
                      size_t errstr_size) __attribute__((warn_unused_result));

#endif
