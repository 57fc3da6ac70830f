/* db.h - the outbox table over libpq. The db files (db.c: connection and
 * waiting; db_claim.c: claiming and settling rows; db_table.c: table-wide
 * statements) are the only ones that include libpq. */
#ifndef OUTBOX_DB_H
#define OUTBOX_DB_H

#include <stddef.h>

#include "event.h"

struct db;

/* ---- connection and waiting (db.c) ---- */

/* Creates an unconnected handle; copies the strings. NULL on allocation
 * failure. `table` must have passed config_check_identifier(). */
struct db *db_new(const char *url, const char *table, const char *relay_id);

/* How the lock statements order an aggregate's versions (OUTBOX_ORDERING;
 * docs/DESIGN.md, "Per-aggregate order"): consecutive versions, each after
 * its predecessor was published (a missing one holds the rest); versions that
 * only increase; or none. Consecutive by default; set before connecting. */
enum db_order { DB_ORDER_CONSECUTIVE = 0, DB_ORDER_INCREASING, DB_ORDER_NONE };
void db_set_order(struct db *db, enum db_order order);

/* Fault-test pauses, in builds with -DOUTBOX_TEST_HOOKS=ON only (0: none):
 * every lock statement waits lock_delay_ms between its start and its row
 * locks (from the next connect on), every table sample takes sample_delay_ms
 * longer. */
void db_set_test_hooks(struct db *db, int lock_delay_ms, int sample_delay_ms);

/* (Re)connects: opens the connection, checks the server's version, resolves
 * the table (schema and name), LISTENs on its channel and prepares the
 * statements. 0, or -1 (errstr set, no password in it), or
 * DB_ERR_SERVER_VERSION: the server is older than the oldest PostgreSQL major
 * the programs support (deploy/versions' PG_MIN_MAJOR), so connecting again
 * cannot help (errstr names the version). */
#define DB_ERR_SERVER_VERSION (-2)
int db_connect(struct db *db, char *errstr, size_t errstr_size) __attribute__((warn_unused_result));

/* Nonzero while the connection is believed good. */
int db_connected(const struct db *db);

/* Drops the connection (db_connect() may follow). */
void db_disconnect(struct db *db);

/* How many times db_connect() succeeded: a change tells a caller that the
 * connection was replaced (and what it had sent may have been lost). */
long db_connects(const struct db *db);

/* The server process serving the connection (0 when not connected). */
int db_backend_pid(const struct db *db);

/* Waits up to timeout_ms for a NOTIFY on the table's channel. 1 notified,
 * 0 timed out or interrupted by a signal, -1 connection lost. */
int db_wait(struct db *db, int timeout_ms);

/* Closes and frees. NULL is a no-op. */
void db_destroy(struct db *db);

/* ---- claiming and settling rows (db_claim.c) ----
 * Only the lock statements take rows; every other statement here changes a
 * row only while status = PUBLISHING and locked_by = this relay. */

/* Rows locked for this relay. The events borrow from the lock statements'
 * results: valid until db_batch_clear(). Zero-initialise. */
struct db_batch {
        struct outbox_event *events;
        size_t count;
        size_t bytes; /* what the rows' values take in memory (the byte budget's measure) */
        void *priv;
};

/* The lock statements (docs/DESIGN.md, "Status machine", steps 1 and 2). Each
 * locks at most `limit` due rows into PUBLISHING and returns them ordered by
 * aggregate and version. */
enum db_lock_kind {
        DB_LOCK_WINDOW, /* the oldest due rows, all of them (OUTBOX_ORDERING=none) */
        /* the rows of that window that the per-aggregate guard lets go: several
         * consecutive versions of one aggregate may come, and version n+1 must
         * then be published only after n was acknowledged (released if n
         * failed) */
        DB_LOCK_RUNS,
        /* the lowest unpublished version of aggregates, wherever they are:
         * tops up a short batch (its scan steps over every blocked row) */
        DB_LOCK_HEADS
};

/* Runs a lock statement and adds its rows to b (empty or not: a batch takes
 * up to three): at most `limit` rows, and rows only while their bytes stay
 * within `bytes` (always at least one row, however large). 0, or -1 with
 * errstr set (the connection dropped when it failed). *unknown is set when
 * rows may be locked for this relay that b did not get (the outcome was lost
 * with the connection, or out of memory): db_take_back_own() returns them. */
int db_lock(struct db *db, enum db_lock_kind kind, int limit, long long bytes, struct db_batch *b,
            int *unknown, char *errstr, size_t errstr_size) __attribute__((warn_unused_result));

/* db_lock() in two halves, so the caller can work while the server locks:
 * db_lock_send() sends the statement, db_lock_receive() waits for its rows.
 * Between the two the connection takes nothing else; db_lock_receive() must
 * follow every successful db_lock_send() (it fails at once if the connection
 * was lost). */
int db_lock_send(struct db *db, enum db_lock_kind kind, int limit, long long bytes, char *errstr,
                 size_t errstr_size) __attribute__((warn_unused_result));
int db_lock_receive(struct db *db, struct db_batch *b, int *unknown, char *errstr,
                    size_t errstr_size) __attribute__((warn_unused_result));

/* Nonzero between db_lock_send() and db_lock_receive(). */
int db_lock_in_flight(const struct db *db);
/* Reads what has arrived of the lock statement's result without waiting, so
 * the server can finish (and commit) it while the caller does other work.
 * Nonzero while more is to come. */
int db_lock_poll(struct db *db);

/* Frees the batch's rows and results; b is empty afterwards. */
void db_batch_clear(struct db_batch *b);

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

/* Marks outcomes: one statement (its own transaction) per kind of mark, and
 * sets `marked` on the outcomes it applied. *lost gets the number of rows
 * whose lock was taken back meanwhile. 0, or -1 with errstr set: call again
 * with the same array after reconnecting, and only the outcomes not yet
 * marked are applied. */
int db_mark(struct db *db, struct db_outcome *outs, size_t n, size_t *lost, char *errstr,
            size_t errstr_size) __attribute__((warn_unused_result));

/* Takes back the rows this relay id holds in PUBLISHING: call only with no
 * batch in flight (after a reconnect, or at start after a crash of a process
 * with the same id). They go FAILED with STALE_LOCK, due now, or DEAD when
 * attempt_count >= max_attempts. *n gets the count. */
int db_take_back_own(struct db *db, int max_attempts, long long *n, char *errstr,
                     size_t errstr_size) __attribute__((warn_unused_result));

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

/* A version gap: the lowest unpublished version of an aggregate (held) waits
 * for versions prev_version + 1 .. held_version - 1, which are not in the
 * table. Names longer than the fields are cut. */
struct db_gap {
        char tenant_id[128], aggregate_type[128], aggregate_id[256];
        long long held_version, prev_version;
        double age_s; /* since the held row was inserted */
};

/* Version gaps whose held row was inserted at least min_age_s ago, oldest
 * first: at most `max` into gaps (*n of them), and *total, how many there are
 * among the oldest 10000 due rows. */
int db_version_gaps(struct db *db, int min_age_s, struct db_gap *gaps, size_t max, size_t *n,
                    long long *total, char *errstr, size_t errstr_size)
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

/* The planner's estimate of the unpublished rows (what the guard's probes
 * choose their index by). 0, or -1 with errstr set. */
int db_planned_unpublished(struct db *db, double *rows, char *errstr, size_t errstr_size)
        __attribute__((warn_unused_result));

/* ANALYZE on the table. 0, or -1 with errstr set (also when this role is
 * neither the table's owner nor a superuser: PostgreSQL would only warn). */
int db_analyze(struct db *db, char *errstr, size_t errstr_size) __attribute__((warn_unused_result));

/* One query for the table gauges: counts by status (PUBLISHED from the
 * statistics collector's live-row count, the others exact) and the age in
 * seconds of the oldest PENDING or FAILED row (0 when none). */
int db_sample(struct db *db, double counts[DB_ROW_STATUS_COUNT], double *oldest_age_s, char *errstr,
              size_t errstr_size) __attribute__((warn_unused_result));

/* ---- operator statements (db_admin.c: outboxctl) ---- */

/* Makes db an operator's connection, before db_connect(): it then prepares
 * the operator statements only (never the daemons'), LISTENs on nothing and
 * names itself outboxctl. A row's topic is topic_name, else
 * `topic_template` (OUTBOX_TOPIC_TEMPLATE, copied) filled in as the relay
 * does. 0, or -1 out of memory. */
int db_set_admin(struct db *db, const char *topic_template) __attribute__((warn_unused_result));

/* A query result copied out of libpq: ncols column names, then nrows rows of
 * ncols cells (row-major; NULL for SQL NULL), and per column whether it is
 * a number (printed right-aligned). Freed with db_rows_free(). */
struct db_rows {
        int nrows, ncols;
        char **names;
        char **cells;
        int *numeric;
};

/* Frees r and everything in it; NULL is a no-op. */
void db_rows_free(struct db_rows *r);

/* Rows by status (every status, 0 when none: an exact count), and the age in
 * whole seconds of the oldest due row ("-" when none). *counts and *oldest
 * are the caller's to free. */
int db_admin_stats(struct db *db, struct db_rows **counts, struct db_rows **oldest, char *errstr,
                   size_t errstr_size) __attribute__((warn_unused_result));

/* At most `limit` DEAD rows, by aggregate and version: id, tenant,
 * aggregate, version, attempts, code, message (80 characters), updated_at. */
int db_admin_dead(struct db *db, long long limit, struct db_rows **out, char *errstr,
                  size_t errstr_size) __attribute__((warn_unused_result));

/* At most `limit` version gaps, oldest first: tenant, aggregate, the held
 * version, the missing versions ("from-to") and how long it has been held. */
int db_admin_gaps(struct db *db, long long limit, struct db_rows **out, char *errstr,
                  size_t errstr_size) __attribute__((warn_unused_result));

/* Which DEAD rows a requeue moves: exactly one of outbox_id, the aggregate
 * (tenant_id, aggregate_type, aggregate_id) or all_dead (with `code`: only
 * rows whose last_error_code it is). Strings are borrowed. */
struct db_requeue {
        const char *outbox_id; /* a UUID */
        const char *tenant_id, *aggregate_type, *aggregate_id;
        int all_dead;
        const char *code;
};

/* DEAD -> PENDING (attempt_count 0, due now), in one statement that touches
 * DEAD rows only; the versions the sweeper parked behind them are due again
 * where their aggregate has no other DEAD version. *moved and *freed get the
 * two counts. */
int db_admin_requeue(struct db *db, const struct db_requeue *q, long long *moved, long long *freed,
                     char *errstr, size_t errstr_size) __attribute__((warn_unused_result));

/* Releases the version gap that holds the aggregate: records versions
 * *from..*to as released (a PUBLISHED row of event_type
 * 'outbox.gap-released', last_error_code GAP_RELEASED, never sent) at the
 * version below the held one. *released is 0 when no gap holds it. */
int db_admin_release_gap(struct db *db, const char *tenant_id, const char *aggregate_type,
                         const char *aggregate_id, int *released, long long *from, long long *to,
                         char *errstr, size_t errstr_size) __attribute__((warn_unused_result));

/* What a replay starts from: one aggregate's rows (from `from_version`
 * when has_from), or the PUBLISHED rows published in [since, until) (RFC
 * 3339), of `topics` when ntopics > 0. Strings are borrowed. */
struct db_replay_select {
        const char *tenant_id, *aggregate_type, *aggregate_id;
        int has_from;
        long long from_version;
        const char *since, *until;
        const char *const *topics;
        size_t ntopics;
};

/* Finds the aggregates a replay touches and, for each, the lowest version it
 * replays from, into a temp table of this connection, numbered 1..
 * *aggregates. *rows gets the rows the selection matched. */
int db_replay_select(struct db *db, const struct db_replay_select *s, long long *aggregates,
                     long long *rows, char *errstr, size_t errstr_size)
        __attribute__((warn_unused_result));

/* What a replay does with the rows from each selected aggregate's start
 * version up: a replay always runs to an aggregate's latest version, so that
 * no later version stays published ahead of the replayed ones. */
struct db_replay_counts {
        long long moved, moved_aggregates;           /* PUBLISHED -> PENDING */
        long long busy, busy_aggregates;             /* PUBLISHED, but a version of the aggregate
                                                      * is PUBLISHING now: left as they are */
        long long below_release;                     /* PUBLISHED below a released gap: left */
        long long released;                          /* GAP_RELEASED records: never replayed */
        long long unpublished;                       /* not PUBLISHED: left as they are */
        long long pending, failed, dead, publishing; /* unpublished, by status */
};

/* Adds what replaying aggregates first..last (db_replay_select()'s numbers)
 * would do to *c and changes nothing; with examples > 0, *ex gets up to that
 * many rows it would move (id, tenant, aggregate, version, topic,
 * published_at), else NULL. */
int db_replay_plan(struct db *db, long long first, long long last, long long examples,
                   struct db_replay_counts *c, struct db_rows **ex, char *errstr,
                   size_t errstr_size) __attribute__((warn_unused_result));

/* Replays aggregates first..last in one transaction that holds the table
 * in SHARE ROW EXCLUSIVE mode (no relay locks or marks a row and no
 * application inserts one meanwhile, so none can publish a later version of
 * an aggregate ahead of the replayed ones). The moved rows are PENDING, due
 * now, attempt_count 0, published_at NULL. Adds to *c. A lock not granted
 * within lock_timeout_ms sets *lock_timeout and changes nothing. */
int db_replay_run(struct db *db, long long first, long long last, int lock_timeout_ms,
                  int *lock_timeout, struct db_replay_counts *c, char *errstr, size_t errstr_size)
        __attribute__((warn_unused_result));

/* Reconcile, step 1: the PUBLISHED rows published in [since, until) (RFC
 * 3339), not GAP_RELEASED records, of `topics` when ntopics > 0, into a temp
 * table of this connection. *rows gets their count, *released the
 * GAP_RELEASED records left out, *topics_out their distinct topics (the
 * caller frees). */
int db_reconcile_rows(struct db *db, const char *since, const char *until,
                      const char *const *topics, size_t ntopics, long long *rows,
                      long long *released, struct db_rows **topics_out, char *errstr,
                      size_t errstr_size) __attribute__((warn_unused_result));

/* One message read from Kafka. Header values are bytes (not NUL-terminated,
 * NULL when absent); event_id is the event-id header when it is a UUID, else
 * NULL. */
struct db_reconcile_msg {
        const char *topic;
        int partition;
        long long offset, timestamp_ms;
        const char *event_id;
        const char *tenant_id, *aggregate_type, *aggregate_id, *aggregate_version;
        size_t tenant_id_len, aggregate_type_len, aggregate_id_len, aggregate_version_len;
};

/* Step 2: streams the messages into a temp table with COPY. begin, then put
 * for each message (buffered: the connection takes nothing else meanwhile),
 * then end. Header values are cut to 256 bytes. */
int db_reconcile_begin(struct db *db, char *errstr, size_t errstr_size)
        __attribute__((warn_unused_result));
int db_reconcile_put(struct db *db, const struct db_reconcile_msg *m, char *errstr,
                     size_t errstr_size) __attribute__((warn_unused_result));
int db_reconcile_end(struct db *db, char *errstr, size_t errstr_size)
        __attribute__((warn_unused_result));

/* Step 3, in PostgreSQL: the counts (docs/DESIGN.md, "Reconciling with
 * Kafka"). */
struct db_reconcile_counts {
        long long rows, messages;
        long long missing;    /* rows with no message */
        long long reorders;   /* first copies after a first copy of a higher version of
                               * their aggregate in their partition */
        long long duplicates; /* event ids with more than one message */
        long long copies;     /* messages beyond the first of each event id */
        long long unknown;    /* messages whose event id is not in the table */
};
int db_reconcile_counts(struct db *db, struct db_reconcile_counts *c, char *errstr,
                        size_t errstr_size) __attribute__((warn_unused_result));

/* Step 4: up to `limit` examples of one count. */
enum db_reconcile_kind {
        DB_RC_MISSING,    /* id, tenant, aggregate, version, topic, published_at */
        DB_RC_REORDERS,   /* topic, partition, offset, tenant, aggregate, version, after_version */
        DB_RC_DUPLICATES, /* event_id, copies, where (topic[partition]@offset ...) */
        DB_RC_UNKNOWN     /* topic, partition, offset, event_id, aggregate, version (headers) */
};
int db_reconcile_examples(struct db *db, enum db_reconcile_kind kind, long long limit,
                          struct db_rows **out, char *errstr, size_t errstr_size)
        __attribute__((warn_unused_result));

#endif
