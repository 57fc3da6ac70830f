/* db_table.c - the sweeper's statements over the whole table: the
 * stale-lock reset, retention and parking. Each is one
 * statement (its own transaction) on at most `limit` rows, taken with SKIP
 * LOCKED, so sweepers and relays never wait for each other. */
#include "db.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "db_internal.h"
#include "errstr.h"

enum { S_RESET_STALE, S_DELETE_PUBLISHED, S_DELETE_KEEP_LATEST, S_PARK, S_UNPARK, S_COUNT };

/* A DEAD row that holds its aggregate's later versions: every DEAD row but a
 * LATE_VERSION one, whose place in the order is already lost (a later
 * version reached Kafka before it was committed): the versions after it
 * follow the published ones. */
#define HOLDING "status = 'DEAD' AND last_error_code IS DISTINCT FROM 'LATE_VERSION'"

/* Row a's aggregate key, as outbox_event_agg_published_idx has it. */
#define AGG_KEY(a)                                                                                 \
        "hashtextextended(" a ".aggregate_id, hashtextextended(" a ".aggregate_type,"              \
        " hashtextextended(" a ".tenant_id, 0)))"
#define P_KEY AGG_KEY("p")
#define O_KEY AGG_KEY("o")

const struct db_stmt db_table_stmts[S_COUNT] = {
        /* A lock older than the lock timeout ($1 s), through the due index
         * (none covers locked_at): a row is locked only once due, so its
         * available_at is older still. FAILED and due now, or DEAD (parked)
         * once its attempts ($3) are used up: a row that kills every relay
         * that takes it must not loop, whatever the relays' ids. Returns
         * (reset, of those DEAD). */
        [S_RESET_STALE] = {"reset_stale", "reset stale locks", 3,
                           "WITH stale AS (SELECT outbox_id FROM %1$s"
                           " WHERE published_at IS NULL"
                           " AND available_at < now() - $1 * interval '1 second'"
                           " AND status = 'PUBLISHING'"
                           " AND locked_at < now() - $1 * interval '1 second'"
                           " ORDER BY available_at, aggregate_version"
                           " LIMIT $2 FOR UPDATE SKIP LOCKED),"
                           " reset AS (UPDATE %1$s o SET status = CASE"
                           "  WHEN o.attempt_count >= $3 THEN 'DEAD' ELSE 'FAILED' END,"
                           " available_at = CASE WHEN o.attempt_count >= $3"
                           "  THEN 'infinity'::timestamptz ELSE now() END,"
                           " last_error_code = 'STALE_LOCK',"
                           " last_error_message = 'lock of ' || coalesce(o.locked_by, '?')"
                           "  || ' expired after ' || $1 || ' s' || CASE"
                           "  WHEN o.attempt_count >= $3 THEN ', attempt ' || o.attempt_count"
                           "   || ' of ' || $3 || ': the row may be what stops its relays'"
                           "  ELSE '' END,"
                           " locked_by = NULL, locked_at = NULL, updated_at = clock_timestamp()"
                           " FROM stale WHERE o.outbox_id = stale.outbox_id RETURNING o.status)"
                           " SELECT count(*), count(*) FILTER (WHERE status = 'DEAD') FROM reset"},
        /* PUBLISHED rows published more than $1 s ago, oldest first (kept
         * rows, at available_at 'infinity', are out of the index's range).
         * Returns (deleted, looked at). */
        [S_DELETE_PUBLISHED] = {"delete_published", "delete published", 2,
                                "WITH gone AS (DELETE FROM %1$s WHERE outbox_id IN ("
                                " SELECT outbox_id FROM %1$s"
                                " WHERE published_at IS NOT NULL AND available_at <> 'infinity'"
                                " AND published_at < now() - $1 * interval '1 second'"
                                " ORDER BY published_at LIMIT $2 FOR UPDATE SKIP LOCKED)"
                                " RETURNING 1) SELECT count(*), count(*) FROM gone"},
        /* The same, keeping each aggregate's latest published row: the
         * consecutive-versions guard tells a gap from an aggregate's first
         * version by it. A row below a published version of its aggregate
         * goes (a probe of outbox_event_agg_published_idx, per row: a
         * subquery with a LIMIT is never made a join); a latest one
         * is parked at 'infinity', out of this scan for good, and the row it
         * replaces as its aggregate's latest goes. */
        [S_DELETE_KEEP_LATEST] =
                {"delete_keep_latest", "delete published", 2,
                 "WITH cand AS MATERIALIZED (SELECT o.outbox_id, o.tenant_id, o.aggregate_type,"
                 "  o.aggregate_id, o.aggregate_version,"
                 "  (SELECT true FROM %1$s p WHERE p.published_at IS NOT NULL"
                 "   AND " P_KEY " = " O_KEY " AND p.aggregate_version > o.aggregate_version"
                 "   AND p.tenant_id = o.tenant_id COLLATE \"C\""
                 "   AND p.aggregate_type = o.aggregate_type COLLATE \"C\""
                 "   AND p.aggregate_id = o.aggregate_id COLLATE \"C\""
                 "   ORDER BY " P_KEY ", p.aggregate_version"
                 "   LIMIT 1) AS superseded"
                 "  FROM %1$s o WHERE o.published_at IS NOT NULL AND o.available_at <> 'infinity'"
                 "  AND o.published_at < now() - $1 * interval '1 second'"
                 "  ORDER BY o.published_at LIMIT $2 FOR UPDATE SKIP LOCKED),"
                 " kept AS (UPDATE %1$s o SET available_at = 'infinity',"
                 "  updated_at = clock_timestamp() FROM cand c"
                 "  WHERE o.outbox_id = c.outbox_id AND c.superseded IS NOT TRUE RETURNING 1),"
                 " gone AS (DELETE FROM %1$s o WHERE o.outbox_id = ANY (ARRAY("
                 "  SELECT outbox_id FROM cand WHERE superseded UNION ALL"
                 "  SELECT k.outbox_id FROM cand c CROSS JOIN LATERAL ("
                 "   SELECT p.outbox_id FROM %1$s p WHERE p.tenant_id = c.tenant_id"
                 "   AND p.aggregate_type = c.aggregate_type AND p.aggregate_id = c.aggregate_id"
                 "   AND p.aggregate_version < c.aggregate_version"
                 "   AND p.published_at IS NOT NULL AND p.available_at = 'infinity') k))"
                 "  AND o.published_at IS NOT NULL RETURNING 1)"
                 " SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM cand)"},
        /* Parks the PENDING and FAILED versions above the lowest DEAD one of
         * their aggregate. One read of the parked range (DEAD and parked
         * rows) finds each DEAD aggregate and its highest parked version;
         * parking walks on from there in version order, so a long queue is
         * parked in one pass over it. A version a lock statement holds
         * (SKIP LOCKED), or one below the highest parked version (the relays'
         * lock statements park the versions they meet, not in version order),
         * stays due: the lock statement that meets it parks it. */
        [S_PARK] = {"park_blocked", "park blocked versions", 1,
                    "WITH dead AS MATERIALIZED (SELECT tenant_id, aggregate_type, aggregate_id,"
                    "  min(aggregate_version) FILTER (WHERE " HOLDING ") AS v,"
                    "  max(aggregate_version) FILTER (WHERE status <> 'DEAD') AS parked"
                    "  FROM %1$s WHERE published_at IS NULL AND available_at = 'infinity'"
                    "  GROUP BY 1, 2, 3 HAVING bool_or(" HOLDING "))"
                    " UPDATE %1$s o SET available_at = 'infinity', last_error_code = 'BLOCKED',"
                    " last_error_message = 'parked behind a DEAD version of its aggregate"
                    " (due again when that is requeued, published or deleted)',"
                    " updated_at = clock_timestamp()"
                    " WHERE o.outbox_id = ANY (ARRAY("
                    "  SELECT x.outbox_id FROM dead d CROSS JOIN LATERAL ("
                    "   SELECT s.outbox_id FROM %1$s s WHERE s.tenant_id = d.tenant_id"
                    "   AND s.aggregate_type = d.aggregate_type"
                    "   AND s.aggregate_id = d.aggregate_id"
                    "   AND s.published_at IS NULL"
                    "   AND s.aggregate_version > greatest(d.v, d.parked)"
                    "   AND s.status IN ('PENDING', 'FAILED') AND s.available_at <> 'infinity'"
                    "   ORDER BY s.aggregate_version LIMIT $1 FOR UPDATE SKIP LOCKED) x"
                    "  LIMIT $1))"
                    " AND o.status IN ('PENDING', 'FAILED')"},
        /* Makes parked versions due once no DEAD version of their aggregate
         * is below them (every one when $2 = 1). One sort of the parked
         * range gives each row the lowest DEAD version of its aggregate.
         * Both parking statements hand their rows to the UPDATE as an
         * array, found by primary key: no join whose plan a misestimate
         * could turn quadratic. */
        [S_UNPARK] = {"unpark_blocked", "unpark versions", 2,
                      "UPDATE %1$s o SET available_at = now(), last_error_code = NULL,"
                      " last_error_message = NULL, updated_at = clock_timestamp()"
                      " WHERE o.outbox_id = ANY (ARRAY("
                      "  SELECT outbox_id FROM (SELECT outbox_id, status, aggregate_version,"
                      "   min(aggregate_version) FILTER (WHERE " HOLDING ")"
                      "    OVER (PARTITION BY tenant_id, aggregate_type, aggregate_id) AS dead_v"
                      "   FROM %1$s WHERE published_at IS NULL AND available_at = 'infinity') inf"
                      "  WHERE status IN ('PENDING', 'FAILED')"
                      "  AND (dead_v IS NULL OR aggregate_version < dead_v OR $2 = 1) LIMIT $1))"
                      " AND o.published_at IS NULL AND o.available_at = 'infinity'"
                      " AND o.status IN ('PENDING', 'FAILED')"},
};
const size_t db_table_stmt_count = S_COUNT;

/* A statement's integer parameters ($1 .. $3) as text. */
struct int_params {
        char text[3][24];
        const char *p[3];
};

static const char *const *int_params(struct int_params *ip, long long a, long long b, long long c) {
        long long v[3] = {a, b, c};
        for (int i = 0; i < 3; i++) {
                snprintf(ip->text[i], sizeof ip->text[i], "%lld", v[i]);
                ip->p[i] = ip->text[i];
        }
        return ip->p;
}

/* Runs a row-count statement with up to two integer parameters. */
static int run_count(struct db *db, int stmt, long long p1, long long p2, long long *n,
                     char *errstr, size_t size) {
        struct int_params ip;
        *n = 0;
        if (!db_connected(db))
                return errstr_set(errstr, size, "not connected");
        return db_run_count(db, &db_table_stmts[stmt], int_params(&ip, p1, p2, 0), n, errstr, size);
}

/* Runs a statement with up to three integer parameters that returns one row
 * of two counts. */
static int counts_of(struct db *db, int stmt, long long p1, long long p2, long long p3,
                     long long *a, long long *b, char *errstr, size_t size) {
        struct int_params ip;
        *a = *b = 0;
        if (!db_connected(db))
                return errstr_set(errstr, size, "not connected");
        PGresult *r = db_run(db, &db_table_stmts[stmt], int_params(&ip, p1, p2, p3),
                             PGRES_TUPLES_OK, errstr, size);
        if (!r)
                return -1;
        if (PQntuples(r) != 1 || PQnfields(r) != 2) {
                PQclear(r);
                return errstr_set(errstr, size, "%s: unexpected result", db_table_stmts[stmt].what);
        }
        *a = strtoll(PQgetvalue(r, 0, 0), NULL, 10);
        *b = strtoll(PQgetvalue(r, 0, 1), NULL, 10);
        PQclear(r);
        return 0;
}

int db_reset_stale(struct db *db, int lock_timeout_s, int max_attempts, int limit, long long *n,
                   long long *dead, char *errstr, size_t errstr_size) {
        return counts_of(db, S_RESET_STALE, lock_timeout_s, limit, max_attempts, n, dead, errstr,
                         errstr_size);
}

int db_delete_published(struct db *db, long long retention_s, int limit, int keep_latest,
                        long long *deleted, long long *seen, char *errstr, size_t errstr_size) {
        return counts_of(db, keep_latest ? S_DELETE_KEEP_LATEST : S_DELETE_PUBLISHED, retention_s,
                         limit, 0, deleted, seen, errstr, errstr_size);
}

int db_park_blocked(struct db *db, int limit, long long *n, char *errstr, size_t errstr_size) {
        return run_count(db, S_PARK, limit, 0, n, errstr, errstr_size);
}

int db_unpark_blocked(struct db *db, int all, int limit, long long *n, char *errstr,
                      size_t errstr_size) {
        return run_count(db, S_UNPARK, limit, all ? 1 : 0, n, errstr, errstr_size);
}
