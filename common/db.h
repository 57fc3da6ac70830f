/* db.h - the outbox table over libpq. The db files are the only ones that
 * include libpq: db.c (the handle, blocking use for the sweeper and
 * outboxctl), db_async.c (the same handle driven by the relay's poll loop);
 * db_admin.c and db_migrate.c (outboxctl's, db_admin.h: a library of their
 * own that only outboxctl links). The daemons' statements are .sql files of
 * their own (relay/sql, sweeper/sql, common/sql for the one both run). */
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
 * prepared), then an admin connection's own set-up. 0 or -1 (errstr set, no
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

#endif
