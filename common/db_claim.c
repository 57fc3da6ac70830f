/* db_claim.c - claiming and settling rows: the lock statements, the marks
 * and the take-back of own locks.
 *
 * Only the lock statements take rows. Every other statement here changes a
 * row only while this relay holds it: it is fenced by status = 'PUBLISHING'
 * AND locked_by = $1 (HELD below), so a lock the sweeper took back, or that
 * another relay took since, is never overwritten. Every statement here takes
 * this relay's id as $1. */
#include "db.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "db_internal.h"
#include "encode.h"
#include "errstr.h"

/* Lock statements whose rows one batch may hold. */
#define BATCH_RESULTS_MAX 3

/* Rows this relay holds: the fence of every statement but the locks. */
#define HELD " AND status = 'PUBLISHING' AND locked_by = $1"

/* The columns a lock statement returns before attempt_count, ctid and
 * late_after, in enum col order (struct outbox_event's), computed once per
 * chosen row (`o`, before the lock changes it; none of these changes): c_hdr
 * is the headers_json object as netstrings (see event.h), NULL when not an
 * object; occurred_at is formatted as RFC 3339 UTC by the server. ROW_BYTES
 * is what a row's text weighs in the relay, for the byte budget. */
#define ROW_COLUMNS                                                                                \
        "o.outbox_id::text AS c_id, o.tenant_id AS c_tenant, o.aggregate_type AS c_atype,"         \
        " o.aggregate_id AS c_aid, o.aggregate_version AS c_v, o.event_type AS c_etype,"           \
        " o.event_version AS c_ever, o.topic_name AS c_topic, o.partition_key AS c_pkey,"          \
        " o.event_key AS c_ekey, o.payload_json::text AS c_payload,"                               \
        " CASE WHEN o.headers_json = '{}' THEN ''"                                                 \
        "  WHEN jsonb_typeof(o.headers_json) = 'object' THEN COALESCE(("                           \
        "   SELECT string_agg(octet_length(h.key)::text || ':' || h.key || "                       \
        "          octet_length(h.v)::text || ':' || h.v, '' ORDER BY h.key) "                     \
        "   FROM (SELECT key, CASE WHEN jsonb_typeof(value) = 'string' "                           \
        "                THEN value #>> '{}' ELSE value::text END AS v "                           \
        "         FROM jsonb_each(o.headers_json)) h), '') END AS c_hdr,"                          \
        " o.correlation_id AS c_corr, o.causation_id AS c_cause, o.trace_id AS c_trace,"           \
        " to_char(o.occurred_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') AS "      \
        "c_occ,"                                                                                   \
        " extract(epoch FROM o.occurred_at)::float8 AS c_epoch"
#define ROW_COLUMN_NAMES                                                                           \
        "s.c_id, s.c_tenant, s.c_atype, s.c_aid, s.c_v, s.c_etype, s.c_ever, s.c_topic,"           \
        " s.c_pkey, s.c_ekey, s.c_payload, s.c_hdr, s.c_corr, s.c_cause, s.c_trace, s.c_occ,"      \
        " s.c_epoch"
#define ROW_BYTES                                                                                  \
        "(octet_length(c_id) + octet_length(c_tenant) + octet_length(c_atype)"                     \
        " + octet_length(c_aid) + octet_length(c_etype) + coalesce(octet_length(c_topic), 0)"      \
        " + coalesce(octet_length(c_pkey), 0) + coalesce(octet_length(c_ekey), 0)"                 \
        " + coalesce(octet_length(c_payload), 0) + coalesce(octet_length(c_hdr), 0)"               \
        " + coalesce(octet_length(c_corr), 0) + coalesce(octet_length(c_cause), 0)"                \
        " + coalesce(octet_length(c_trace), 0))"

enum col {
        C_ID,
        C_TENANT,
        C_AGG_TYPE,
        C_AGG_ID,
        C_AGG_VERSION,
        C_EVENT_TYPE,
        C_EVENT_VERSION,
        C_TOPIC,
        C_PKEY,
        C_EVENT_KEY,
        C_PAYLOAD,
        C_HEADERS,
        C_CORRELATION,
        C_CAUSATION,
        C_TRACE,
        C_OCCURRED,
        C_OCCURRED_EPOCH,
        C_ATTEMPTS,
        C_TID,
        C_LATE_AFTER,
        C_NCOLS
};

/* The lock statements are a window, a choice of its rows, and a tail
 * (docs/DESIGN.md, "Status machine" steps 1 and 2); $2 is the batch size.
 *
 * The window: the oldest due rows, lower versions first among rows due at
 * the same time, taken with SKIP LOCKED; `guard` narrows it. `vis` keeps the
 * rows whose locked version the statement can see, so the UPDATE finds them
 * by ctid (a TID scan, no index descent). FOR UPDATE locks, and returns, the
 * newest version of a row another transaction changed after the statement
 * began; the statement cannot update that version, so the row sits this
 * batch out, and to the guard it is a version the window lacks. */
#define LOCK_WINDOW(guard)                                                                         \
        "WITH hz AS MATERIALIZED (SELECT pg_snapshot_xmin(pg_current_snapshot()) AS xmin),"        \
        " win AS MATERIALIZED ("                                                                   \
        " SELECT o.ctid AS tid, o.outbox_id, o.tenant_id, o.aggregate_type,"                       \
        "  o.aggregate_id, o.aggregate_version, o.txid FROM %1$s o"                                \
        " WHERE o.published_at IS NULL AND o.status IN ('PENDING','FAILED')"                       \
        "  AND o.available_at <= now()%2$s" guard " ORDER BY o.available_at, o.aggregate_version"  \
        " LIMIT $2 FOR UPDATE OF o SKIP LOCKED),"                                                  \
        " vis AS MATERIALIZED (SELECT w.* FROM win w"                                              \
        "  WHERE EXISTS (SELECT 1 FROM %1$s c WHERE c.ctid = w.tid))"

/* The guards are scalar subqueries on purpose: as NOT EXISTS, the planner may
 * hash-join each row with every version of its aggregate, quadratic in a hot
 * aggregate's backlog. They probe downwards: a blocked version finds its
 * unpublished predecessor at once; only a head walks past the index entries
 * its published versions left until VACUUM removes them. The probes over all
 * rows, published or not (PREV, LATE_AFTER), use the table's unique key. */

/* The row's inserting transaction is older than every transaction still
 * running (`hz`): every row a transaction older than it wrote is in sight,
 * committed or rolled back. NULL (rows older than the txid column) counts as
 * old. */
#define HORIZON_PASSED(txid) "(" txid " IS NULL OR " txid " < (SELECT xmin FROM hz))"

/* Probe `p` of the same aggregate as `a`. */
#define SAME_AGG(a)                                                                                \
        " p.tenant_id = " a ".tenant_id AND p.aggregate_type = " a ".aggregate_type"               \
        " AND p.aggregate_id = " a ".aggregate_id"

/* The highest unpublished version of `a`'s aggregate below `v` (NULL: none). */
#define BEHIND(a, v)                                                                               \
        "(SELECT p.aggregate_version FROM %1$s p WHERE" SAME_AGG(                                  \
                a) " AND p.published_at IS NULL AND p.aggregate_version < " v                      \
                   " ORDER BY p.aggregate_version DESC LIMIT 1)"

/* The highest version of `a`'s aggregate below `v`, of any status. */
#define PREV(a, v)                                                                                 \
        "(SELECT p.aggregate_version FROM %1$s p WHERE" SAME_AGG(                                  \
                a) " AND p.aggregate_version < " v " ORDER BY p.aggregate_version DESC LIMIT 1)"

/* The version of the aggregate's next row above `v` when that row is
 * published already (a row at `v` would reach Kafka after it); NULL when the
 * next row is unpublished or there is none. */
#define LATE_AFTER(a, v)                                                                           \
        "(SELECT CASE WHEN p.published_at IS NOT NULL THEN p.aggregate_version END"                \
        " FROM %1$s p WHERE" SAME_AGG(a) " AND p.aggregate_version > " v                           \
                                         " ORDER BY p.aggregate_version LIMIT 1)"

/* Consecutive versions: version `v` (first of its aggregate's unpublished
 * ones) follows `prev`, the aggregate's highest version below it. It may go
 * when prev = v - 1, or, with no lower version in the table at all, when it
 * is the aggregate's first: version 1, or any version once `settled` (every
 * transaction older than its own has ended, so a predecessor still being
 * inserted would be in sight). A lower version with versions missing after
 * it is a gap: held until they come or an operator releases it. */
#define CONSECUTIVE(v, prev, settled) "coalesce(" prev " = " v " - 1, " v " = 1 OR " settled ")"

/* Window guards of the classic lock (lock_heads, a top-up): the row is the
 * lowest unpublished version of its aggregate and not late, and its order
 * rule holds. Its scan steps over blocked rows. */
#define HEAD_GUARD  " AND " HEAD_BEHIND " IS NULL AND " HEAD_LATE " IS NULL"
#define HEAD_BEHIND BEHIND("o", "o.aggregate_version")
#define HEAD_LATE   LATE_AFTER("o", "o.aggregate_version")
#define HEADS_CONSECUTIVE                                                                          \
        HEAD_GUARD " AND " CONSECUTIVE("o.aggregate_version", PREV("o", "o.aggregate_version"),    \
                                       HORIZON_PASSED("o.txid"))
#define HEADS_INCREASING HEAD_GUARD " AND " HORIZON_PASSED("o.txid")

/* Runs of versions: a row of the window is ready when every unpublished
 * version of its aggregate below it is in the window too. Per aggregate:
 * nothing unpublished below its lowest version in the window (`gap` keeps
 * only such aggregates, before it probes anything else for them), and
 * only rows below `missing`, the lowest unpublished version between its
 * lowest and highest that the window lacks (probed only when the window
 * holds more than one version: rows of one version never hold each other
 * back). Nothing of an aggregate goes while an earlier version is in flight,
 * backing off, DEAD or held by another relay; the cost follows the window,
 * not the backlog. A run whose next row above is published already is late:
 * its rows are locked with late_after set, to go DEAD unsent.
 *
 * `runs` gives each window row `first` (it is in the aggregate's first run
 * of consecutive versions: version minus dense rank is constant along a run)
 * and `is_lo` (it has the aggregate's lowest version in the window);
 * `prev` is the aggregate's previous version (a probe, so only where `ok`,
 * the order rule on top of the guard, reads it). */
#define RUNS(top, prev, ok) AGG(top) GAP(prev) READY(ok)
#define AGG(top)                                                                                   \
        ", agg AS (SELECT tenant_id, aggregate_type, aggregate_id,"                                \
        "  min(aggregate_version) AS lo, " top " AS top,"                                          \
        "  bool_and(" TXID_PASSED ") FILTER (WHERE is_lo) AS lo_settled"                           \
        "  FROM runs GROUP BY 1, 2, 3),"
#define TXID_PASSED HORIZON_PASSED("txid")
#define GAP(prev)                                                                                  \
        " gap AS MATERIALIZED (SELECT a.*, " prev " AS prev, " GAP_LATE " AS late_after,"          \
        "  CASE WHEN a.lo < a.top THEN (SELECT p.aggregate_version FROM %1$s p"                    \
        "   WHERE" GAP_SAME_AGG " AND p.aggregate_version BETWEEN a.lo AND a.top"                  \
        "   AND p.published_at IS NULL"                                                            \
        "   AND p.outbox_id NOT IN (SELECT outbox_id FROM vis)"                                    \
        "   ORDER BY p.aggregate_version LIMIT 1) END AS missing"                                  \
        "  FROM agg a WHERE " GAP_BEHIND " IS NULL),"
#define GAP_BEHIND   BEHIND("a", "a.lo")
#define GAP_PREV     PREV("a", "a.lo")
#define GAP_LATE     LATE_AFTER("a", "a.top")
#define GAP_SAME_AGG SAME_AGG("a")
#define READY(ok)                                                                                  \
        " ready AS (SELECT w.tid, w.outbox_id, g.late_after FROM runs w JOIN gap g"                \
        "  ON g.tenant_id = w.tenant_id AND g.aggregate_type = w.aggregate_type"                   \
        "  AND g.aggregate_id = w.aggregate_id"                                                    \
        "  WHERE w.aggregate_version <= g.top"                                                     \
        "  AND (g.missing IS NULL OR w.aggregate_version < g.missing)"                             \
        "  AND (g.late_after IS NOT NULL OR (" ok ")))"

/* Versions that only increase (gaps are normal): the guard alone, on rows
 * whose transaction is past the horizon (the window only holds such). */
#define RUNS_INCREASING                                                                            \
        ", runs AS (SELECT v.*, true AS first, true AS is_lo FROM vis v)" RUNS(                    \
                "max(aggregate_version)", "NULL::bigint", "true")

/* Consecutive versions: the window's first run of each aggregate, its lowest
 * version following the aggregate's previous one (CONSECUTIVE). */
#define RUNS_CONSECUTIVE                                                                           \
        ", ranked AS (SELECT v.*, v.aggregate_version - dense_rank() OVER ("                       \
        "   PARTITION BY tenant_id, aggregate_type, aggregate_id"                                  \
        "   ORDER BY aggregate_version) AS run FROM vis v),"                                       \
        " runs AS (SELECT r.*, r.run = min(r.run) OVER a AS first,"                                \
        "  r.aggregate_version = min(r.aggregate_version) OVER a AS is_lo"                         \
        "  FROM ranked r WINDOW a AS (PARTITION BY tenant_id, aggregate_type, "                    \
        "aggregate_id))" RUNS("max(aggregate_version) FILTER (WHERE first)", GAP_PREV,             \
                              CONSECUTIVE("g.lo", "g.prev", "g.lo_settled"))

/* The tail: the chosen rows (`from`), in lock order, while their bytes stay
 * within the budget ($3; always the first row, so one row larger than the
 * budget still goes, or goes DEAD), go PUBLISHING for this relay. Each row's
 * text is made once, in `cols`; rows come back ordered by aggregate and
 * version, with late_after (`late`). */
#define LOCK_TAIL(from, late)                                                                      \
        ", cols AS MATERIALIZED (SELECT r.tid, r.outbox_id AS c_uuid, " late " AS c_late,"         \
        " o.available_at AS c_due, " ROW_COLUMNS " FROM " from                                     \
        " r JOIN %1$s o ON o.ctid = r.tid AND o.outbox_id = r.outbox_id),"                         \
        " sized AS (SELECT c.*, coalesce(sum(" ROW_BYTES ") OVER (ORDER BY c_due, c_v, c_id"       \
        "  ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS before FROM cols c),"          \
        " locked AS ("                                                                             \
        " UPDATE %1$s o SET status = 'PUBLISHING', locked_by = $1,"                                \
        "  locked_at = now(), last_attempt_at = now(),"                                            \
        "  attempt_count = o.attempt_count + 1, updated_at = clock_timestamp()"                    \
        " FROM sized s WHERE o.ctid = s.tid AND o.outbox_id = s.c_uuid AND s.before < $3"          \
        " RETURNING " ROW_COLUMN_NAMES ", o.attempt_count, o.ctid::text, s.c_late)"                \
        " SELECT * FROM locked ORDER BY 2, 3, 4, 5"

/* The marks' columns when a row leaves this relay. */
#define UNLOCK " locked_by = NULL, locked_at = NULL, updated_at = clock_timestamp()"

enum {
        S_LOCK_UNORDERED,
        S_LOCK_RUNS_CONSECUTIVE,
        S_LOCK_HEADS_CONSECUTIVE,
        S_LOCK_RUNS_INCREASING,
        S_LOCK_HEADS_INCREASING,
        S_MARK_RELEASED,
        S_MARK_PUBLISHED,
        S_MARK_PUBLISHED_ID,
        S_MARK_UNPUBLISHED,
        S_TAKE_BACK_OWN,
        S_COUNT
};

const struct db_stmt db_claim_stmts[S_COUNT] = {
        /* The statements of enum db_lock_kind, per enum db_order. */
        [S_LOCK_UNORDERED] = {"lock_unordered", "lock_unordered", 3,
                              LOCK_WINDOW("") LOCK_TAIL("vis", "NULL::bigint")},
        [S_LOCK_RUNS_CONSECUTIVE] = {"lock_runs", "lock_runs", 3,
                                     LOCK_WINDOW("")
                                             RUNS_CONSECUTIVE LOCK_TAIL("ready", "r.late_after")},
        [S_LOCK_HEADS_CONSECUTIVE] = {"lock_heads", "lock_heads", 3,
                                      LOCK_WINDOW(HEADS_CONSECUTIVE)
                                              LOCK_TAIL("vis", "NULL::bigint")},
        [S_LOCK_RUNS_INCREASING] = {"lock_runs_increasing", "lock_runs", 3,
                                    LOCK_WINDOW(" AND " HORIZON_PASSED("o.txid"))
                                            RUNS_INCREASING LOCK_TAIL("ready", "r.late_after")},
        [S_LOCK_HEADS_INCREASING] = {"lock_heads_increasing", "lock_heads", 3,
                                     LOCK_WINDOW(HEADS_INCREASING)
                                             LOCK_TAIL("vis", "NULL::bigint")},
        /* Rows locked but never produced go back as they were, the attempt
         * not counted: FAILED if an attempt had been made before, else
         * PENDING. */
        [S_MARK_RELEASED] = {"mark_released", "mark_released", 2,
                             "UPDATE %1$s SET status = CASE WHEN attempt_count > 1"
                             "  THEN 'FAILED' ELSE 'PENDING' END,"
                             " attempt_count = attempt_count - 1," UNLOCK
                             " WHERE outbox_id = ANY($2::uuid[])" HELD},
        /* Found by the ctid ($3) the lock returned (a TID scan, no index
         * descent); mark_published_id catches a row an update moved since. */
        [S_MARK_PUBLISHED] = {"mark_published", "mark_published", 3,
                              "UPDATE %1$s SET status = 'PUBLISHED', published_at = now()," UNLOCK
                              " WHERE ctid = ANY($3::tid[])"
                              " AND outbox_id = ANY($2::uuid[])" HELD},
        [S_MARK_PUBLISHED_ID] =
                {"mark_published_id", "mark_published_id", 2,
                 "UPDATE %1$s SET status = 'PUBLISHED', published_at = now()," UNLOCK
                 " WHERE outbox_id = ANY($2::uuid[])" HELD},
        /* FAILED ($2) due after a backoff, or DEAD parked at 'infinity';
         * uncount restores an attempt that does not count. */
        [S_MARK_UNPUBLISHED] = {"mark_unpublished", "mark_unpublished", 7,
                                "UPDATE %1$s o SET status = $2,"
                                " available_at = CASE WHEN $2 = 'FAILED'"
                                "  THEN now() + u.delay_ms * interval '1 millisecond'"
                                "  ELSE 'infinity' END,"
                                " last_error_code = u.code, last_error_message = u.msg,"
                                " attempt_count = o.attempt_count - u.uncount," UNLOCK
                                " FROM unnest($3::uuid[], $4::bigint[], $5::text[], $6::text[],"
                                "  $7::int[]) AS u(id, delay_ms, code, msg, uncount)"
                                " WHERE o.outbox_id = u.id" HELD},
        /* Rows this relay id still holds when no batch is in flight: a lock
         * statement whose result was lost with the connection, or an earlier
         * process with the same id that died. Like the sweeper's stale-lock
         * reset, but at once; a row whose attempts ($2) are used up goes DEAD,
         * so a row that keeps killing its relay cannot loop forever. */
        [S_TAKE_BACK_OWN] = {"take_back_own", "take back own locks", 2,
                             "UPDATE %1$s SET status = CASE WHEN attempt_count >= $2"
                             "  THEN 'DEAD' ELSE 'FAILED' END,"
                             " available_at = CASE WHEN attempt_count >= $2"
                             "  THEN 'infinity'::timestamptz ELSE now() END,"
                             " last_error_code = 'STALE_LOCK',"
                             " last_error_message = 'lock of ' || locked_by"
                             "  || ' taken back by the same relay id after a reconnect"
                             " or restart'," UNLOCK
                             " WHERE published_at IS NULL AND available_at <= now()" HELD},
};
const size_t db_claim_stmt_count = S_COUNT;

/* The results behind a batch. */
struct batch_results {
        PGresult *r[BATCH_RESULTS_MAX];
        int n;
};

/* Sends one lock statement without waiting for it. A connection the server
 * already closed, or said it is closing (what has arrived is read first), is
 * dropped without sending: the statement is known not to have run. */
static int send_lock(struct db *db, const struct db_stmt *stmt, int limit, long long bytes,
                     char *errstr, size_t size) {
        char lim[16], budget[24];
        const char *params[3] = {db->relay_id, lim, budget};
        snprintf(lim, sizeof lim, "%d", limit);
        snprintf(budget, sizeof budget, "%lld", bytes);
        if (!PQconsumeInput(db->conn) || PQstatus(db->conn) != CONNECTION_OK || db->closing) {
                errstr_set(errstr, size, "%s: not sent: %s", stmt->what,
                           db->closing ? "the server is closing the connection"
                                       : PQerrorMessage(db->conn));
                db_disconnect(db);
                return -1;
        }
        if (!PQsendQueryPrepared(db->conn, stmt->name, 3, params, NULL, NULL, 0)) {
                errstr_set(errstr, size, "%s: %s", stmt->what, PQerrorMessage(db->conn));
                db_check_conn(db);
                return -1;
        }
        return 0;
}

/* Waits for the result of the lock statement sent last (NULL with errstr set).
 * An error after the rows (the statement commits at its end, and may fail
 * there, or the connection may be lost before) wins, as in PQexecPrepared(). */
static PGresult *get_lock(struct db *db, const struct db_stmt *stmt, int *unknown, char *errstr,
                          size_t size) {
        PGresult *r = PQgetResult(db->conn), *more;
        while ((more = PQgetResult(db->conn)) != NULL) {
                if (PQresultStatus(more) == PGRES_TUPLES_OK) {
                        PQclear(more);
                        continue;
                }
                PQclear(r);
                r = more;
        }
        if (PQresultStatus(r) != PGRES_TUPLES_OK || PQnfields(r) != C_NCOLS ||
            PQstatus(db->conn) != CONNECTION_OK) {
                errstr_set(errstr, size, "%s: %s", stmt->what, PQerrorMessage(db->conn));
                /* An error the server sent (it has a SQLSTATE: a statement
                 * error, a commit that failed, a backend terminated by an
                 * administrator or a shutdown) rolled the statement back. A
                 * connection lost without one leaves its outcome unknown. */
                *unknown = PQstatus(db->conn) != CONNECTION_OK &&
                           !PQresultErrorField(r, PG_DIAG_SQLSTATE) && !db->closing;
                db_check_result(db, r);
                PQclear(r);
                return NULL;
        }
        return r;
}

/* Parses PostgreSQL's float8 text of an epoch ("1763856000.123456"): plain
 * digits and one point by hand (strtod's exact rounding costs more than a
 * latency metric needs); anything else (exponent, sign) through strtod. */
static double parse_epoch(const char *s) {
        double whole = 0, frac = 0, scale = 1;
        const char *p = s;
        for (; *p >= '0' && *p <= '9'; p++)
                whole = whole * 10 + (*p - '0');
        if (*p == '.')
                for (p++; *p >= '0' && *p <= '9' && scale < 1e18; p++) {
                        frac = frac * 10 + (*p - '0');
                        scale *= 10;
                }
        /* a digit left over means more than 18 decimals: strtod too */
        return *p || p == s ? strtod(s, NULL) : whole + frac / scale;
}

/* Points events at the rows of r; returns the bytes the rows' values take. */
static size_t fill_events(PGresult *r, struct outbox_event *events) {
        size_t bytes = 0;
#define V(col) (PQgetisnull(r, i, col) ? NULL : PQgetvalue(r, i, col))
#define S(col) PQgetvalue(r, i, col) /* NOT NULL columns: "" never NULL */
        for (int i = 0; i < PQntuples(r); i++) {
                struct outbox_event *e = &events[i];
                e->outbox_id = V(C_ID);
                e->tenant_id = V(C_TENANT);
                e->aggregate_type = V(C_AGG_TYPE);
                e->aggregate_id = V(C_AGG_ID);
                e->aggregate_version = strtoll(S(C_AGG_VERSION), NULL, 10);
                e->event_type = V(C_EVENT_TYPE);
                e->event_version = atoi(S(C_EVENT_VERSION));
                e->topic_name = V(C_TOPIC);
                e->partition_key = V(C_PKEY);
                e->event_key = V(C_EVENT_KEY);
                e->payload = V(C_PAYLOAD);
                e->payload_len = e->payload ? (size_t)PQgetlength(r, i, C_PAYLOAD) : 0;
                e->headers = V(C_HEADERS);
                e->correlation_id = V(C_CORRELATION);
                e->causation_id = V(C_CAUSATION);
                e->trace_id = V(C_TRACE);
                e->occurred_at = V(C_OCCURRED);
                e->occurred_at_epoch = parse_epoch(S(C_OCCURRED_EPOCH));
                e->attempt_count = atoi(S(C_ATTEMPTS));
                e->tid = V(C_TID);
                e->late = !PQgetisnull(r, i, C_LATE_AFTER);
                e->late_after = e->late ? strtoll(S(C_LATE_AFTER), NULL, 10) : 0;
                for (int c = 0; c < C_NCOLS; c++)
                        bytes += (size_t)PQgetlength(r, i, c);
        }
#undef V
#undef S
        return bytes;
}

/* Adds r's rows to b, which keeps r (a result without rows is freed). */
static int add_rows(struct db_batch *b, PGresult *r, int *unknown, char *errstr, size_t size) {
        size_t add = (size_t)PQntuples(r);
        struct batch_results *br = b->priv;
        struct outbox_event *ev = NULL;
        if (add == 0) {
                PQclear(r);
                return 0;
        }
        if (br && br->n == BATCH_RESULTS_MAX) {
                errstr_set(errstr, size, "a batch takes at most %d lock statements",
                           BATCH_RESULTS_MAX);
                goto fail;
        }
        if (!(ev = realloc(b->events, (b->count + add) * sizeof *b->events))) {
                errstr_set(errstr, size, "out of memory for %zu rows", add);
                goto fail;
        }
        b->events = ev; /* they point into the results, which stay where they are */
        if (!br && !(br = b->priv = calloc(1, sizeof *br))) {
                errstr_set(errstr, size, "out of memory for %zu rows", add);
                goto fail;
        }
        b->bytes += fill_events(r, ev + b->count);
        b->count += add;
        br->r[br->n++] = r;
        return 0;
fail:
        *unknown = 1; /* the rows stay PUBLISHING */
        PQclear(r);
        return -1;
}

static const struct db_stmt *lock_stmt(const struct db *db, enum db_lock_kind kind) {
        int consecutive = db->order == DB_ORDER_CONSECUTIVE;
        if (db->order == DB_ORDER_NONE || kind == DB_LOCK_WINDOW)
                return &db_claim_stmts[S_LOCK_UNORDERED];
        if (kind == DB_LOCK_HEADS)
                return &db_claim_stmts[consecutive ? S_LOCK_HEADS_CONSECUTIVE
                                                   : S_LOCK_HEADS_INCREASING];
        return &db_claim_stmts[consecutive ? S_LOCK_RUNS_CONSECUTIVE : S_LOCK_RUNS_INCREASING];
}

int db_lock_send(struct db *db, enum db_lock_kind kind, int limit, long long bytes, char *errstr,
                 size_t errstr_size) {
        if (!db_connected(db))
                return errstr_set(errstr, errstr_size, "not connected");
        if (db->lock_sent)
                return errstr_set(errstr, errstr_size, "a lock statement is in flight");
        const struct db_stmt *stmt = lock_stmt(db, kind);
        if (send_lock(db, stmt, limit, bytes, errstr, errstr_size) != 0)
                return -1;
        db->lock_sent = stmt;
        return 0;
}

int db_lock_receive(struct db *db, struct db_batch *b, int *unknown, char *errstr,
                    size_t errstr_size) {
        const struct db_stmt *stmt = db->lock_sent;
        *unknown = 0;
        if (!stmt)
                return errstr_set(errstr, errstr_size, "no lock statement in flight");
        db->lock_sent = NULL;
        if (!db_connected(db))
                return errstr_set(errstr, errstr_size, "not connected");
        PGresult *r = get_lock(db, stmt, unknown, errstr, errstr_size);
        return r ? add_rows(b, r, unknown, errstr, errstr_size) : -1;
}

int db_lock(struct db *db, enum db_lock_kind kind, int limit, long long bytes, struct db_batch *b,
            int *unknown, char *errstr, size_t errstr_size) {
        *unknown = 0;
        if (db_lock_send(db, kind, limit, bytes, errstr, errstr_size) != 0)
                return -1;
        return db_lock_receive(db, b, unknown, errstr, errstr_size);
}

int db_lock_in_flight(const struct db *db) {
        return db->lock_sent != NULL;
}

int db_lock_poll(struct db *db) {
        /* a lost connection shows in db_lock_receive() */
        return db->lock_sent && db->conn && PQconsumeInput(db->conn) && PQisBusy(db->conn);
}

void db_batch_clear(struct db_batch *b) {
        if (!b)
                return;
        struct batch_results *br = b->priv;
        if (br) {
                for (int i = 0; i < BATCH_RESULTS_MAX; i++)
                        PQclear(br->r[i]);
                free(br);
        }
        free(b->events);
        memset(b, 0, sizeof *b);
}

/* Appends s as an element of a PostgreSQL array literal (NULL as NULL). */
static int array_elem(struct buf *a, const char *s) {
        if (a->len > 1 && buf_append(a, ",", 1))
                return -1;
        if (!s)
                return buf_append(a, "NULL", 4);
        if (buf_append(a, "\"", 1))
                return -1;
        /* copy runs between characters that need a backslash */
        for (;;) {
                size_t run = strcspn(s, "\"\\");
                if (buf_append(a, s, run))
                        return -1;
                s += run;
                if (!*s)
                        break;
                if (buf_append(a, "\\", 1) || buf_append(a, s, 1))
                        return -1;
                s++;
        }
        return buf_append(a, "\"", 1);
}

/* Rolls back an open transaction after a failed statement (best effort: a
 * lost connection has no transaction left). */
static void abort_tx(struct db *db) {
        if (db->conn && PQtransactionStatus(db->conn) != PQTRANS_IDLE) {
                PGresult *r = PQexec(db->conn, "ROLLBACK");
                PQclear(r);
                db_check_conn(db);
        }
}

/* Runs a mark statement; adds affected rows to *done. */
static int run_mark(struct db *db, int stmt, const char *const *params, long long *done,
                    char *errstr, size_t size) {
        long long n;
        if (db_run_count(db, &db_claim_stmts[stmt], params, &n, errstr, size) != 0)
                return -1;
        *done += n;
        return 0;
}

/* The array parameters db_mark() builds, one PostgreSQL array literal each. */
enum { A_IDS, A_TIDS, A_DELAYS, A_CODES, A_MSGS, A_UNCOUNTS, A_COUNT };

int db_mark(struct db *db, struct db_outcome *outs, size_t n, size_t *lost, char *errstr,
            size_t errstr_size) {
        struct buf a[A_COUNT] = {{0}};
        long long done = 0;
        size_t expected = 0;
        int rc = -1;

        *lost = 0;
        if (!db_connected(db))
                return errstr_set(errstr, errstr_size, "not connected");
        for (int mark = DB_MARK_PUBLISHED; mark <= DB_MARK_RELEASED; mark++) {
                size_t cnt = 0;
                for (int k = 0; k < A_COUNT; k++) {
                        buf_reset(&a[k]);
                        if (buf_append(&a[k], "{", 1))
                                goto oom;
                }
                for (size_t i = 0; i < n; i++) {
                        if ((int)outs[i].mark != mark || outs[i].marked)
                                continue;
                        cnt++;
                        if (array_elem(&a[A_IDS], outs[i].outbox_id) ||
                            (mark == DB_MARK_PUBLISHED && array_elem(&a[A_TIDS], outs[i].tid)))
                                goto oom;
                        if (mark != DB_MARK_FAILED && mark != DB_MARK_DEAD)
                                continue; /* the other arrays are for mark_unpublished */
                        char d[24];
                        snprintf(d, sizeof d, "%lld", outs[i].delay_ms);
                        if (array_elem(&a[A_DELAYS], d) || array_elem(&a[A_CODES], outs[i].code) ||
                            array_elem(&a[A_MSGS], outs[i].message) ||
                            array_elem(&a[A_UNCOUNTS], outs[i].uncounted ? "1" : "0"))
                                goto oom;
                }
                if (!cnt)
                        continue;
                for (int k = 0; k < A_COUNT; k++)
                        if (buf_append(&a[k], "}", 1))
                                goto oom;
                expected += cnt;
                if (mark == DB_MARK_PUBLISHED) {
                        /* By ctid, then by outbox_id for rows an update moved
                         * since the lock: one transaction, so a failure in
                         * between leaves nothing half marked (which a retry
                         * would count as lost locks). */
                        const char *p[3] = {db->relay_id, a[A_IDS].data, a[A_TIDS].data};
                        long long by_tid = 0, by_id = 0;
                        if (db_exec_simple(db, "BEGIN", errstr, errstr_size) ||
                            run_mark(db, S_MARK_PUBLISHED, p, &by_tid, errstr, errstr_size) ||
                            (by_tid < (long long)cnt &&
                             run_mark(db, S_MARK_PUBLISHED_ID, p, &by_id, errstr, errstr_size)) ||
                            db_exec_simple(db, "COMMIT", errstr, errstr_size)) {
                                abort_tx(db);
                                goto out;
                        }
                        done += by_tid + by_id;
                } else if (mark == DB_MARK_RELEASED) {
                        const char *p[2] = {db->relay_id, a[A_IDS].data};
                        if (run_mark(db, S_MARK_RELEASED, p, &done, errstr, errstr_size))
                                goto out;
                } else {
                        const char *p[7] = {
                                db->relay_id,      mark == DB_MARK_FAILED ? "FAILED" : "DEAD",
                                a[A_IDS].data,     a[A_DELAYS].data,
                                a[A_CODES].data,   a[A_MSGS].data,
                                a[A_UNCOUNTS].data};
                        if (run_mark(db, S_MARK_UNPUBLISHED, p, &done, errstr, errstr_size))
                                goto out;
                }
                for (size_t i = 0; i < n; i++)
                        if ((int)outs[i].mark == mark)
                                outs[i].marked = 1;
        }
        *lost = expected > (size_t)done ? expected - (size_t)done : 0;
        rc = 0;
        goto out;
oom:
        rc = errstr_set(errstr, errstr_size, "out of memory");
out:
        for (int k = 0; k < A_COUNT; k++)
                buf_free(&a[k]);
        return rc;
}

int db_take_back_own(struct db *db, int max_attempts, long long *n, char *errstr,
                     size_t errstr_size) {
        char m[24];
        const char *params[2] = {db->relay_id, m};
        *n = 0;
        if (!db_connected(db))
                return errstr_set(errstr, errstr_size, "not connected");
        snprintf(m, sizeof m, "%d", max_attempts);
        return db_run_count(db, &db_claim_stmts[S_TAKE_BACK_OWN], params, n, errstr, errstr_size);
}
