/* db_table.c - statements over the whole table: the sweeper's stale-lock
 * reset, retention and parking, and the relay's table sample. Each is one
 * statement (its own transaction) on at most `limit` rows, taken with SKIP
 * LOCKED, so sweepers and relays never wait for each other. */
#include "db.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "db_internal.h"
#include "errstr.h"

const char *const db_row_status_names[DB_ROW_STATUS_COUNT] = {[DB_ROW_PENDING] = "PENDING",
                                                              [DB_ROW_PUBLISHING] = "PUBLISHING",
                                                              [DB_ROW_PUBLISHED] = "PUBLISHED",
                                                              [DB_ROW_FAILED] = "FAILED",
                                                              [DB_ROW_DEAD] = "DEAD"};

enum {
        S_RESET_STALE,
        S_DELETE_PUBLISHED,
        S_DELETE_KEEP_LATEST,
        S_GAPS,
        S_PARK,
        S_UNPARK,
        S_SAMPLE,
        S_PLANNED_UNPUBLISHED,
        S_ANALYZE,
        S_MAY_ANALYZE,
#ifdef OUTBOX_TEST_HOOKS
        S_TEST_SLEEP,
#endif
        S_COUNT
};

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
         * version by it. A row whose next version is published already goes;
         * a latest one is parked at 'infinity', out of this scan for good,
         * and the row it replaces as its aggregate's latest goes. */
        [S_DELETE_KEEP_LATEST] =
                {"delete_keep_latest", "delete published", 2,
                 "WITH cand AS MATERIALIZED (SELECT o.outbox_id, o.tenant_id, o.aggregate_type,"
                 "  o.aggregate_id, o.aggregate_version,"
                 "  (SELECT p.published_at IS NOT NULL FROM %1$s p"
                 "   WHERE p.tenant_id = o.tenant_id AND p.aggregate_type = o.aggregate_type"
                 "   AND p.aggregate_id = o.aggregate_id"
                 "   AND p.aggregate_version > o.aggregate_version"
                 "   ORDER BY p.aggregate_version LIMIT 1) AS superseded"
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
        /* Version gaps: heads (the lowest unpublished version of their
         * aggregate) among the oldest due rows inserted more than $1 s ago,
         * whose aggregate's previous version is below v - 1. Held rows stay
         * due and old, so they are among the oldest; reading at most 10000
         * keeps the cost bounded whatever the backlog. At most $2 rows,
         * oldest first, each with the count of all. */
        [S_GAPS] = {"version_gaps", "version gaps", 2,
                    "WITH cand AS MATERIALIZED (SELECT o.tenant_id, o.aggregate_type,"
                    "  o.aggregate_id, o.aggregate_version, o.created_at FROM %1$s o"
                    "  WHERE o.published_at IS NULL AND o.status IN ('PENDING', 'FAILED')"
                    "  AND o.available_at <= now()"
                    "  AND o.created_at < now() - $1 * interval '1 second'"
                    "  ORDER BY o.available_at, o.aggregate_version LIMIT 10000),"
                    " heads AS (SELECT DISTINCT ON (c.tenant_id, c.aggregate_type, c.aggregate_id)"
                    "  c.*, (SELECT p.aggregate_version FROM %1$s p"
                    "   WHERE p.tenant_id = c.tenant_id AND p.aggregate_type = c.aggregate_type"
                    "   AND p.aggregate_id = c.aggregate_id"
                    "   AND p.aggregate_version < c.aggregate_version"
                    "   ORDER BY p.aggregate_version DESC LIMIT 1) AS prev"
                    "  FROM cand c WHERE (SELECT p.aggregate_version FROM %1$s p"
                    "   WHERE p.tenant_id = c.tenant_id AND p.aggregate_type = c.aggregate_type"
                    "   AND p.aggregate_id = c.aggregate_id AND p.published_at IS NULL"
                    "   AND p.aggregate_version < c.aggregate_version LIMIT 1) IS NULL"
                    "  ORDER BY c.tenant_id, c.aggregate_type, c.aggregate_id,"
                    "   c.aggregate_version)"
                    " SELECT tenant_id, aggregate_type, aggregate_id, aggregate_version, prev,"
                    "  extract(epoch FROM now() - created_at)::float8, count(*) OVER ()"
                    " FROM heads WHERE prev < aggregate_version - 1"
                    " ORDER BY created_at LIMIT $2"},
        /* Parks the PENDING and FAILED versions above the lowest DEAD one of
         * their aggregate. One read of the parked range (DEAD and parked
         * rows) finds each DEAD aggregate and its highest parked version;
         * parking walks on from there in version order, so a long queue is
         * parked in one pass over it. A version a lock statement holds
         * (SKIP LOCKED) stays due behind the parked ones, blocked as before. */
        [S_PARK] = {"park_blocked", "park blocked versions", 1,
                    "WITH dead AS MATERIALIZED (SELECT tenant_id, aggregate_type, aggregate_id,"
                    "  min(aggregate_version) FILTER (WHERE status = 'DEAD') AS v,"
                    "  max(aggregate_version) FILTER (WHERE status <> 'DEAD') AS parked"
                    "  FROM %1$s WHERE published_at IS NULL AND available_at = 'infinity'"
                    "  GROUP BY 1, 2, 3 HAVING bool_or(status = 'DEAD'))"
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
                      "   min(aggregate_version) FILTER (WHERE status = 'DEAD')"
                      "    OVER (PARTITION BY tenant_id, aggregate_type, aggregate_id) AS dead_v"
                      "   FROM %1$s WHERE published_at IS NULL AND available_at = 'infinity') inf"
                      "  WHERE status IN ('PENDING', 'FAILED')"
                      "  AND (dead_v IS NULL OR aggregate_version < dead_v OR $2 = 1) LIMIT $1))"
                      " AND o.published_at IS NULL AND o.available_at = 'infinity'"
                      " AND o.status IN ('PENDING', 'FAILED')"},
        /* Counts in enum db_row_status order, then the oldest due row's age:
         * exact over unpublished rows (the partial indexes' predicate);
         * PUBLISHED, which may be millions of rows, from the statistics
         * collector's live-row count (approximate, never a table scan). */
        [S_SAMPLE] = {"sample", "sample", 0,
                      "SELECT count(*) FILTER (WHERE status = 'PENDING'),"
                      " count(*) FILTER (WHERE status = 'PUBLISHING'),"
                      " greatest(coalesce((SELECT n_live_tup FROM pg_stat_user_tables"
                      "  WHERE relid = '%1$s'::regclass), 0) - count(*), 0)::float8,"
                      " count(*) FILTER (WHERE status = 'FAILED'),"
                      " count(*) FILTER (WHERE status = 'DEAD'),"
                      " coalesce(extract(epoch FROM now() - min(created_at)"
                      "  FILTER (WHERE status IN ('PENDING', 'FAILED'))), 0)::float8"
                      " FROM %1$s WHERE published_at IS NULL"},
        /* How many unpublished rows the planner believes there are: the
         * guard's probes choose their index by it. */
        [S_PLANNED_UNPUBLISHED] = {"planned_unpublished", "planner estimate", 0,
                                   "EXPLAIN (FORMAT JSON) SELECT 1 FROM %1$s"
                                   " WHERE published_at IS NULL"},
        [S_ANALYZE] = {"analyze", "analyze", 0, "ANALYZE %1$s"},
        /* ANALYZE by anyone else only warns that it skipped the table. */
        [S_MAY_ANALYZE] = {"may_analyze", "may analyze", 0,
                           "SELECT pg_has_role((SELECT relowner FROM pg_class"
                           " WHERE oid = '%1$s'::regclass), 'USAGE')"
                           " OR (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)"},
#ifdef OUTBOX_TEST_HOOKS
        /* A sample as slow as a large backlog makes it. */
        [S_TEST_SLEEP] = {"test_sleep", "test hook", 1, "SELECT pg_sleep($1 / 1000.0)"},
#endif
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

int db_version_gaps(struct db *db, int min_age_s, struct db_gap *gaps, size_t max, size_t *n,
                    long long *total, char *errstr, size_t errstr_size) {
        char a[16], b[16];
        const char *params[2] = {a, b};
        *n = 0;
        *total = 0;
        if (!db_connected(db))
                return errstr_set(errstr, errstr_size, "not connected");
        snprintf(a, sizeof a, "%d", min_age_s);
        snprintf(b, sizeof b, "%zu", max);
        PGresult *r =
                db_run(db, &db_table_stmts[S_GAPS], params, PGRES_TUPLES_OK, errstr, errstr_size);
        if (!r)
                return -1;
        int rows = PQntuples(r);
        for (int i = 0; i < rows && (size_t)i < max; i++) {
                struct db_gap *g = &gaps[i];
                snprintf(g->tenant_id, sizeof g->tenant_id, "%s", PQgetvalue(r, i, 0));
                snprintf(g->aggregate_type, sizeof g->aggregate_type, "%s", PQgetvalue(r, i, 1));
                snprintf(g->aggregate_id, sizeof g->aggregate_id, "%s", PQgetvalue(r, i, 2));
                g->held_version = strtoll(PQgetvalue(r, i, 3), NULL, 10);
                g->prev_version = strtoll(PQgetvalue(r, i, 4), NULL, 10);
                g->age_s = strtod(PQgetvalue(r, i, 5), NULL);
                *total = strtoll(PQgetvalue(r, i, 6), NULL, 10);
                (*n)++;
        }
        PQclear(r);
        return 0;
}

int db_park_blocked(struct db *db, int limit, long long *n, char *errstr, size_t errstr_size) {
        return run_count(db, S_PARK, limit, 0, n, errstr, errstr_size);
}

int db_unpark_blocked(struct db *db, int all, int limit, long long *n, char *errstr,
                      size_t errstr_size) {
        return run_count(db, S_UNPARK, limit, all ? 1 : 0, n, errstr, errstr_size);
}

int db_sample(struct db *db, double counts[DB_ROW_STATUS_COUNT], double *oldest_age_s, char *errstr,
              size_t errstr_size) {
        if (!db_connected(db))
                return errstr_set(errstr, errstr_size, "not connected");
#ifdef OUTBOX_TEST_HOOKS
        if (db->test_sample_delay_ms) {
                char ms[16];
                const char *p[1] = {ms};
                snprintf(ms, sizeof ms, "%d", db->test_sample_delay_ms);
                PQclear(db_run(db, &db_table_stmts[S_TEST_SLEEP], p, PGRES_TUPLES_OK, errstr,
                               errstr_size));
        }
#endif
        PGresult *r =
                db_run(db, &db_table_stmts[S_SAMPLE], NULL, PGRES_TUPLES_OK, errstr, errstr_size);
        if (!r)
                return -1;
        int rows = PQntuples(r);
        if (rows != 1) {
                PQclear(r);
                return errstr_set(errstr, errstr_size, "sample: %d rows", rows);
        }
        for (int i = 0; i < DB_ROW_STATUS_COUNT; i++)
                counts[i] = strtod(PQgetvalue(r, 0, i), NULL);
        *oldest_age_s = strtod(PQgetvalue(r, 0, DB_ROW_STATUS_COUNT), NULL);
        PQclear(r);
        return 0;
}

int db_planned_unpublished(struct db *db, double *rows, char *errstr, size_t errstr_size) {
        *rows = 0;
        if (!db_connected(db))
                return errstr_set(errstr, errstr_size, "not connected");
        PGresult *r = db_run(db, &db_table_stmts[S_PLANNED_UNPUBLISHED], NULL, PGRES_TUPLES_OK,
                             errstr, errstr_size);
        if (!r)
                return -1;
        /* the server's own JSON: the first "Plan Rows" is the scan's */
        const char *p = PQntuples(r) ? strstr(PQgetvalue(r, 0, 0), "\"Plan Rows\":") : NULL;
        int rc = p ? 0 : errstr_set(errstr, errstr_size, "planner estimate: no Plan Rows");
        if (p)
                *rows = strtod(p + strlen("\"Plan Rows\":"), NULL);
        PQclear(r);
        return rc;
}

int db_analyze(struct db *db, char *errstr, size_t errstr_size) {
        if (!db_connected(db))
                return errstr_set(errstr, errstr_size, "not connected");
        PGresult *may = db_run(db, &db_table_stmts[S_MAY_ANALYZE], NULL, PGRES_TUPLES_OK, errstr,
                               errstr_size);
        if (!may)
                return -1;
        int allowed = PQntuples(may) == 1 && !strcmp(PQgetvalue(may, 0, 0), "t");
        PQclear(may);
        if (!allowed)
                return errstr_set(errstr, errstr_size,
                                  "only the table's owner (or a superuser) may ANALYZE it");
        PGresult *r =
                db_run(db, &db_table_stmts[S_ANALYZE], NULL, PGRES_COMMAND_OK, errstr, errstr_size);
        PQclear(r);
        return r ? 0 : -1;
}
