/* db.h - the outbox table over libpq. The db files (db.c: connection and
 * waiting; db_claim.c: claiming and settling rows; db_table.c: table-wide
 * statements) are the only ones that include libpq. */
#ifndef OUTBOX_DB_H
#define OUTBOX_DB_H

#include <stddef.h>

#include "event.h"

struct db;

/* Rows locked by db_lock_batch(). The events borrow from the query result:
 * valid until db_batch_clear(). */
struct db_batch {
        struct outbox_event *events;
        size_t count;
        void *priv;
};

/* What a mark makes of a row this relay holds. DB_MARK_RELEASED: locked but
 * never produced (its predecessor in the batch failed, or the relay is
 * stopping): back to PENDING/FAILED, the attempt not counted. */
enum db_mark { DB_MARK_PUBLISHED = 0, DB_MARK_FAILED, DB_MARK_DEAD, DB_MARK_RELEASED };

/* One row's outcome for db_mark(). Strings are borrowed. */
struct db_outcome {
        const char *outbox_id;
        const char *tid; /* DB_MARK_PUBLISHED: the event's tid (finds the row without
                          * an index; NULL or stale falls back to outbox_id) */
        enum db_mark mark;
        long long delay_ms;  /* DB_MARK_FAILED: available_at = now() + delay */
        const char *code;    /* DB_MARK_FAILED, DB_MARK_DEAD: last_error_code */
        const char *message; /* last_error_message (never a payload) */
        int uncounted;       /* DB_MARK_FAILED: the attempt does not count (attempt_count
                              * is restored), e.g. the schema registry was down */
        int marked;          /* set by db_mark() once applied; start at 0 */
};

/* The statuses of a row, in the order of db_sample()'s counts. */
enum db_row_status {
        DB_ROW_PENDING = 0,
        DB_ROW_PUBLISHING,
        DB_ROW_PUBLISHED,
        DB_ROW_FAILED,
        DB_ROW_DEAD,
        DB_ROW_STATUS_COUNT
};
/* The status column's values: db_row_status_names[DB_ROW_PUBLISHED] is "PUBLISHED". */
extern const char *const db_row_status_names[DB_ROW_STATUS_COUNT];

/* Creates an unconnected handle; copies the strings. NULL on allocation
 * failure. `table` must have passed config_check_identifier(). */
struct db *db_new(const char *url, const char *table, const char *relay_id);

/* Fault-test pauses, in builds with -DOUTBOX_TEST_HOOKS=ON only (0: none):
 * every lock statement waits lock_delay_ms between its start and its row
 * locks (from the next connect on), every table sample takes sample_delay_ms
 * longer. */
void db_set_test_hooks(struct db *db, int lock_delay_ms, int sample_delay_ms);

/* (Re)connects: opens the connection, resolves the table (schema and name),
 * LISTENs on its channel and prepares the statements. 0 or -1 (errstr set, no
 * password in it). */
int db_connect(struct db *db, char *errstr, size_t errstr_size) __attribute__((warn_unused_result));

/* Nonzero while the connection is believed good. */
int db_connected(const struct db *db);

/* Drops the connection (db_connect() may follow). */
void db_disconnect(struct db *db);

/* Locks at most `limit` due rows into PUBLISHING for this relay, in one
 * statement (DESIGN.md step 1), with the per-aggregate guard unless
 * `ordering_aggregate` is 0. Rows come back ordered by aggregate and version;
 * with the guard, several consecutive versions of one aggregate may come in
 * one batch, and version n+1 must then be published only after n was
 * acknowledged (released if n failed).
 * 0 or -1 (errstr set; the connection is dropped when it failed). */
int db_lock_batch(struct db *db, int limit, int ordering_aggregate, struct db_batch *out,
                  char *errstr, size_t errstr_size) __attribute__((warn_unused_result));

/* db_lock_batch() in two halves, so the caller can work while the server
 * locks: db_lock_send() sends the statement, db_lock_receive() waits for its
 * rows (and tops a short batch up, as db_lock_batch() does). Between the two
 * the connection takes nothing else; db_lock_receive() must follow every
 * successful db_lock_send() (it fails at once if the connection was lost). */
int db_lock_send(struct db *db, int limit, int ordering_aggregate, int top_up, char *errstr,
                 size_t errstr_size) __attribute__((warn_unused_result));
int db_lock_receive(struct db *db, struct db_batch *out, char *errstr, size_t errstr_size)
        __attribute__((warn_unused_result));
/* Adds at most `limit` more due rows to a batch of db_lock_batch() or
 * db_lock_receive() (one more lock statement, no top-up; at most once). The
 * guard keeps them apart: none is a later version of a row already in `b`
 * (that row is PUBLISHING), so each aggregate's rows stay together. */
int db_lock_more(struct db *db, int limit, int ordering_aggregate, struct db_batch *b, char *errstr,
                 size_t errstr_size) __attribute__((warn_unused_result));

/* Nonzero when a lock statement may have locked rows that no caller got:
 * its outcome was lost with the connection, or its rows could not be handed
 * over. db_take_back_own() returns them and clears this. */
int db_locks_unknown(const struct db *db);

/* Nonzero between db_lock_send() and db_lock_receive(). */
int db_lock_in_flight(const struct db *db);
/* Reads what has arrived of the lock statement's result without waiting, so
 * the server can finish (and commit) it while the caller does other work.
 * Nonzero while more is to come. */
int db_lock_poll(struct db *db);

void db_batch_clear(struct db_batch *b);

/* Marks outcomes: one statement (its own transaction) per status, fenced by
 * status = PUBLISHING and locked_by = this relay, and sets `marked` on the
 * outcomes it applied. *lost gets the number of rows whose lock was taken
 * back meanwhile. 0, or -1 with errstr set: call again with the same array
 * after reconnecting, and only the outcomes not yet marked are applied. */
int db_mark(struct db *db, struct db_outcome *outs, size_t n, size_t *lost, char *errstr,
            size_t errstr_size) __attribute__((warn_unused_result));

/* How many times db_connect() succeeded: a change tells a caller that the
 * connection was replaced (and what it had sent may have been lost). */
long db_connects(const struct db *db);

/* The server process serving the connection (0 when not connected). */
int db_backend_pid(const struct db *db);

/* Takes back the rows this relay id holds in PUBLISHING: call only with no
 * batch in flight (after a reconnect, or at start after a crash of a process
 * with the same id). They go FAILED with STALE_LOCK, due now, or DEAD when
 * attempt_count >= max_attempts. *n gets the count. */
int db_take_back_own(struct db *db, int max_attempts, long long *n, char *errstr,
                     size_t errstr_size) __attribute__((warn_unused_result));

/* Waits up to timeout_ms for a NOTIFY on the table's channel. 1 notified,
 * 0 timed out or interrupted by a signal, -1 connection lost. */
int db_wait(struct db *db, int timeout_ms);

/* Sweeper: moves at most `limit` PUBLISHING rows locked longer than
 * lock_timeout_s ago to FAILED (STALE_LOCK, due now). *n gets the count. */
int db_reset_stale(struct db *db, int lock_timeout_s, int limit, long long *n, char *errstr,
                   size_t errstr_size) __attribute__((warn_unused_result));

/* Sweeper: deletes at most `limit` PUBLISHED rows published more than
 * retention_s ago. *n gets the count. */
int db_delete_published(struct db *db, long long retention_s, int limit, long long *n, char *errstr,
                        size_t errstr_size) __attribute__((warn_unused_result));
/* Parks PENDING/FAILED versions behind a DEAD version of their aggregate out
 * of the lock scan (available_at 'infinity', last_error_code BLOCKED), at
 * most `limit` per call. */
int db_park_blocked(struct db *db, int limit, long long *n, char *errstr, size_t errstr_size)
        __attribute__((warn_unused_result));
/* Makes parked versions due again once no DEAD version of their aggregate is
 * below them (every parked version with `all`), at most `limit` per call. */
int db_unpark_blocked(struct db *db, int all, int limit, long long *n, char *errstr,
                      size_t errstr_size) __attribute__((warn_unused_result));

/* One query for the table gauges: counts by status (enum db_row_status;
 * PUBLISHED from the statistics collector's live-row count, the others
 * exact) and the age in seconds of the oldest PENDING or FAILED row (0 when
 * none). */
int db_sample(struct db *db, double counts[DB_ROW_STATUS_COUNT], double *oldest_age_s, char *errstr,
              size_t errstr_size) __attribute__((warn_unused_result));

/* Closes and frees. NULL is a no-op. */
void db_destroy(struct db *db);

#endif
