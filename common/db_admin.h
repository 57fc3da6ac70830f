/* db_admin.h - the operator's statements (db_admin.c, db_migrate.c): a part of
 * the db module that only outboxctl links (the daemons never prepare or
 * carry them). */
#ifndef OUTBOX_DB_ADMIN_H
#define OUTBOX_DB_ADMIN_H

#include <stddef.h>

#include "db.h"

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

/* Keeps the first n rows of r (frees the others); nothing when r has no
 * more. */
void db_rows_truncate(struct db_rows *r, int n);

/* Rows by status (every status, 0 when none: an exact count), and the oldest
 * due row's age in whole seconds and created_at (RFC 3339; both NULL when
 * none). *counts and *oldest are the caller's to free. */
int db_admin_stats(struct db *db, struct db_rows **counts, struct db_rows **oldest, char *errstr,
                   size_t errstr_size) __attribute__((warn_unused_result));

/* At most `limit` DEAD rows, by aggregate and version. For a table: id,
 * tenant, aggregate (TYPE/ID), version, attempts, code, message (80
 * characters), updated_at; with `json`, the columns by their names:
 * outbox_id, tenant_id, aggregate_type, aggregate_id, aggregate_version,
 * event_type, attempt_count, last_error_code, last_error_message,
 * created_at, updated_at. Times are RFC 3339 (UTC). */
int db_admin_dead(struct db *db, long long limit, int json, struct db_rows **out, char *errstr,
                  size_t errstr_size) __attribute__((warn_unused_result));

/* At most `limit` version gaps, oldest first. For a table: tenant,
 * aggregate, the held version, the missing versions ("2", or "2-5") and how
 * long it has been held; with `json`: tenant_id, aggregate_type,
 * aggregate_id, held_version, missing_from, missing_to, held_since (RFC
 * 3339), held_for_s. */
int db_admin_gaps(struct db *db, long long limit, int json, struct db_rows **out, char *errstr,
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

/* What db_admin_requeue() would do, changing nothing: the two counts, at
 * most `limit` of the rows it would move (outbox_id, tenant_id,
 * aggregate_type, aggregate_id, aggregate_version, attempt_count,
 * last_error_code, last_error_message, updated_at) and, per aggregate, the
 * parked versions it would make due (tenant_id, aggregate_type,
 * aggregate_id, parked, from_version, to_version; at most `limit`). The
 * caller frees *rows and *freed_aggs. */
int db_admin_requeue_plan(struct db *db, const struct db_requeue *q, long long limit,
                          long long *moved, long long *freed, struct db_rows **rows,
                          struct db_rows **freed_aggs, char *errstr, size_t errstr_size)
        __attribute__((warn_unused_result));

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
 * many rows it would move (outbox_id, tenant_id, aggregate (TYPE/ID),
 * version, topic, published_at (RFC 3339)), else NULL. */
int db_replay_plan(struct db *db, long long first, long long last, long long examples,
                   struct db_replay_counts *c, struct db_rows **ex, char *errstr,
                   size_t errstr_size) __attribute__((warn_unused_result));

/* A replay step in two statements, each its own transaction, that lock rows
 * and never the table (docs/DESIGN.md, "Replaying"). Both lock every row of
 * their aggregates from the start version up (waiting at most
 * lock_timeout_ms for a row another transaction holds) and leave alone the
 * aggregates with a version PUBLISHING.
 *
 * db_replay_hold(): the PUBLISHED rows of aggregates first..last that a
 * replay moves are held: PUBLISHING, locked_by 'outboxctl replay' (no relay
 * takes them; to the guard they are unpublished), attempt_count 0,
 * published_at NULL, due now; their unpublished rows get a new row version
 * (nothing changes), so a lock statement older than it passes them by. Adds
 * to *c. A lock not granted in time sets *busy and changes nothing. */
int db_replay_hold(struct db *db, long long first, long long last, int lock_timeout_ms, int *busy,
                   struct db_replay_counts *c, char *errstr, size_t errstr_size)
        __attribute__((warn_unused_result));

/* What db_replay_release() did. */
struct db_replay_release {
        long long due;             /* held rows made due */
        long long late;            /* rows published since the hold, replayed with them */
        long long late_aggregates; /* their aggregates */
        long long busy_aggregates; /* aggregates with a version PUBLISHING: still held */
};

/* db_replay_hold()'s second half, for first..last: where no version of an
 * aggregate is PUBLISHING (but its held rows), its held rows become PENDING
 * (due), rows published since the hold are replayed with them (PENDING, due
 * now) and unpublished rows get a new row version. The other aggregates' rows stay held: call
 * again (or db_replay_undo()). A lock not granted in time sets *busy and
 * changes nothing. */
int db_replay_release(struct db *db, long long first, long long last, int *busy,
                      struct db_replay_release *out, char *errstr, size_t errstr_size)
        __attribute__((warn_unused_result));

/* Gives the rows of first..last that are still held back as they were
 * before the hold (PUBLISHED, their published_at, due time, attempts and
 * error columns). *rows and *aggregates get the counts. */
int db_replay_undo(struct db *db, long long first, long long last, long long *rows,
                   long long *aggregates, char *errstr, size_t errstr_size)
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

/* ---- schema migrations (db_migrate.c: outboxctl migrate) ---- */

/* One migration: schemas/postgres/NNN_name.sql, built in. */
struct db_migration {
        int version;      /* NNN */
        const char *name; /* "NNN_name" */
        const char *sql;  /* the file's text */
};

/* Connects db for migrating (no table needed, nothing prepared) and sets
 * search_path to the one schema the migrations apply in: the schema
 * OUTBOX_TABLE names (it must exist), else the schema of the table
 * search_path finds, else the first schema of search_path that exists.
 * Copies its name into schema. 0, or -1 with errstr set (no password in
 * it), or DB_ERR_SERVER_VERSION (db.h) for a server older than supported. */
int db_migrate_connect(struct db *db, char *schema, size_t schema_size, char *errstr,
                       size_t errstr_size) __attribute__((warn_unused_result));

/* Takes the session advisory lock of outboxctl migrate, waiting at most
 * wait_s seconds for another session that holds it. */
int db_migrate_lock(struct db *db, int wait_s, char *errstr, size_t errstr_size)
        __attribute__((warn_unused_result));

/* The highest migration recorded in the schema (0: none), whether the
 * record table exists, whether the outbox table (outbox_event) does. */
int db_migrate_level(struct db *db, int *level, int *recorded, int *table_exists, char *errstr,
                     size_t errstr_size) __attribute__((warn_unused_result));

/* *yes: whether migration `version` is recorded as applied. */
int db_migrate_recorded(struct db *db, int version, int *yes, char *errstr, size_t errstr_size)
        __attribute__((warn_unused_result));

/* db_migrate_apply(): the migration gave up waiting for a lock on the table
 * (lock_timeout, 55P03); nothing changed, and it may be applied again. */
#define DB_ERR_LOCK_TIMEOUT (-3)

/* After DB_ERR_LOCK_TIMEOUT: the sessions holding a lock on the outbox
 * table, at most 5, as "pid=N application=A state=S xact_age_s=T command=C"
 * (or "prepared transaction gid=G prepared_s=T") joined by "; " (the
 * command's first words, never its values); "" when none, "unknown (why)"
 * when the lookup fails. */
void db_migrate_holders(struct db *db, char *out, size_t out_size);

/* Applies m and records it, in one transaction (creating the record table
 * first if it is missing). 0, or -1 or DB_ERR_LOCK_TIMEOUT (it gave up
 * waiting for a lock) with errstr set and nothing changed. */
int db_migrate_apply(struct db *db, const struct db_migration *m, char *errstr, size_t errstr_size)
        __attribute__((warn_unused_result));

#endif
