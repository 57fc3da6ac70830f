/* db.c - SQL of the relay and the sweeper against the outbox table. */
#include "db.h"

#include <errno.h>
#include <libpq-fe.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>

#include "clock.h"
#include "config.h"
#include "db_conninfo.h"
#include "encode.h"
#include "errstr.h"
#include "log.h"

const char *const db_status_names[DB_STATUS_COUNT] = {"PENDING", "PUBLISHING", "PUBLISHED",
                                                      "FAILED", "DEAD"};

struct db {
        char *url, *table, *relay_id;
        PGconn *conn;
        char *qtable;       /* "schema"."table", resolved at connect */
        char *channel;      /* schema.table */
        long connects;      /* successful db_connect() calls */
        double topup_after; /* monotonic time before which lock_heads is skipped */
        /* db_lock_send() sent this lock statement; db_lock_receive() owes its
         * result before the connection takes anything else */
        const char *lock_sent;
        int lock_limit, lock_top_up;
        /* a lock statement may have locked rows that no caller got (its
         * outcome was lost with the connection, or its rows could not be
         * handed over): db_take_back_own() clears it */
        int locks_unknown;
        int closing; /* the server said it is closing this connection (FATAL) */
};

/* Columns every locked row returns, in struct outbox_event order. headers is
 * the headers_json object as netstrings (see event.h), NULL when not an
 * object; occurred_at is formatted as RFC 3339 UTC by the server. */
static const char lock_columns[] =
        "o.outbox_id::text, o.tenant_id, o.aggregate_type, o.aggregate_id, "
        "o.aggregate_version, o.event_type, o.event_version, o.topic_name, "
        "o.partition_key, o.event_key, o.payload_json::text, "
        "CASE WHEN o.headers_json = '{}' THEN ''"
        " WHEN jsonb_typeof(o.headers_json) = 'object' THEN COALESCE(("
        "  SELECT string_agg(octet_length(h.key)::text || ':' || h.key || "
        "         octet_length(h.v)::text || ':' || h.v, '' ORDER BY h.key) "
        "  FROM (SELECT key, CASE WHEN jsonb_typeof(value) = 'string' "
        "               THEN value #>> '{}' ELSE value::text END AS v "
        "        FROM jsonb_each(o.headers_json)) h), '') END, "
        "o.correlation_id, o.causation_id, o.trace_id, "
        "to_char(o.occurred_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), "
        "extract(epoch FROM o.occurred_at)::float8, o.attempt_count, o.ctid::text";

enum {
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
        C_NCOLS
};

struct db *db_new(const char *url, const char *table, const char *relay_id) {
        struct db *db = calloc(1, sizeof *db);
        if (!db)
                return NULL;
        db->url = strdup(url);
        db->table = strdup(table);
        db->relay_id = strdup(relay_id);
        if (!db->url || !db->table || !db->relay_id) {
                db_destroy(db);
                return NULL;
        }
        return db;
}

int db_connected(const struct db *db) {
        return db->conn && PQstatus(db->conn) == CONNECTION_OK;
}

void db_disconnect(struct db *db) {
        if (db->conn)
                PQfinish(db->conn);
        db->conn = NULL;
        db->lock_sent = NULL;
        db->closing = 0;
        free(db->qtable);
        free(db->channel);
        db->qtable = db->channel = NULL;
}

/* Runs a statement without parameters; -1 (errstr set) unless it succeeded. */
static int exec_simple(struct db *db, const char *sql, char *errstr, size_t size) {
        PGresult *r = PQexec(db->conn, sql);
        ExecStatusType st = PQresultStatus(r);
        int rc = 0;
        if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK)
                rc = errstr_set(errstr, size, "%s", PQerrorMessage(db->conn));
        PQclear(r);
        return rc;
}

/* A statement failed: drop the connection if it is gone, so the caller
 * reconnects. */
static void check_conn(struct db *db) {
        if (db->conn && PQstatus(db->conn) != CONNECTION_OK)
                db_disconnect(db);
}

static int prepare(struct db *db, const char *name, const char *sql, int nparams, char *errstr,
                   size_t size) {
        PGresult *r = PQprepare(db->conn, name, sql, nparams, NULL);
        int rc = PQresultStatus(r) == PGRES_COMMAND_OK ? 0
                                                       : errstr_set(errstr, size, "prepare %s: %s",
                                                                    name, PQerrorMessage(db->conn));
        PQclear(r);
        return rc;
}

#ifdef OUTBOX_TEST_HOOKS
/* A fault test's pause in ms from variable `name` (builds with
 * -DOUTBOX_TEST_HOOKS=ON only); 0 when unset. */
static int test_hook_ms(const char *name) {
        const char *v = getenv(name);
        int ms = v ? atoi(v) : 0;
        return ms > 0 ? ms : 0;
}
#endif

/* Statements with the table's name as their only format argument, prepared
 * on every connect. */
static const struct {
        const char *name;
        int nparams;
        const char *fmt;
} table_stmts[] = {
        /* Rows locked but never produced go back as they were, the attempt
         * not counted: FAILED if an attempt had been made before, else PENDING. */
        {"mark_released", 2,
         "UPDATE %s SET status = CASE WHEN attempt_count > 1"
         "  THEN 'FAILED' ELSE 'PENDING' END,"
         " attempt_count = attempt_count - 1,"
         " locked_by = NULL, locked_at = NULL, updated_at = clock_timestamp()"
         " WHERE outbox_id = ANY($1::uuid[]) AND status = 'PUBLISHING'"
         " AND locked_by = $2"},
        /* Found by the ctid the lock returned (a TID scan, no index
         * descent); mark_published_id catches a row an update moved since. */
        {"mark_published", 3,
         "UPDATE %s SET status = 'PUBLISHED', published_at = now(),"
         " locked_by = NULL, locked_at = NULL, updated_at = clock_timestamp()"
         " WHERE ctid = ANY($3::tid[]) AND outbox_id = ANY($1::uuid[])"
         " AND status = 'PUBLISHING' AND locked_by = $2"},
        {"mark_published_id", 2,
         "UPDATE %s SET status = 'PUBLISHED', published_at = now(),"
         " locked_by = NULL, locked_at = NULL, updated_at = clock_timestamp()"
         " WHERE outbox_id = ANY($1::uuid[]) AND status = 'PUBLISHING'"
         " AND locked_by = $2"},
        {"mark_unpublished", 7,
         "UPDATE %s o SET status = $1,"
         " available_at = CASE WHEN $1 = 'FAILED'"
         "  THEN now() + u.delay_ms * interval '1 millisecond'"
         "  ELSE 'infinity' END,"
         " last_error_code = u.code, last_error_message = u.msg,"
         " attempt_count = o.attempt_count - u.uncount,"
         " locked_by = NULL, locked_at = NULL, updated_at = clock_timestamp()"
         " FROM unnest($2::uuid[], $3::bigint[], $4::text[], $5::text[], $7::int[])"
         "  AS u(id, delay_ms, code, msg, uncount)"
         " WHERE o.outbox_id = u.id AND o.status = 'PUBLISHING'"
         " AND o.locked_by = $6"},
        /* Rows this relay id still holds when no batch is in flight: a lock
         * statement whose result was lost with the connection, or a previous
         * process with the same id that died. Like the sweeper's stale-lock
         * reset, but at once; a row whose attempts are used up goes DEAD (a
         * row that keeps killing its relay must not loop forever). */
        {"take_back_own", 2,
         "UPDATE %s SET status = CASE WHEN attempt_count >= $2"
         "  THEN 'DEAD' ELSE 'FAILED' END,"
         " available_at = CASE WHEN attempt_count >= $2"
         "  THEN 'infinity'::timestamptz ELSE now() END,"
         " last_error_code = 'STALE_LOCK',"
         " last_error_message = 'lock of ' || locked_by"
         "  || ' taken back by the same relay id after a reconnect or restart',"
         " locked_by = NULL, locked_at = NULL, updated_at = clock_timestamp()"
         " WHERE published_at IS NULL AND available_at <= now()"
         " AND status = 'PUBLISHING' AND locked_by = $1"},
};

static int prepare_all(struct db *db, char *errstr, size_t size) {
        const char *t = db->qtable;
        struct buf sql = {0};
        int rc = -1;

        /* Lock (DESIGN.md steps 1 and 2). Three statements share a head
         * (`win`: the oldest due rows, lower versions first among rows due at
         * the same time, taken with SKIP LOCKED) and a tail (`locked`: set
         * PUBLISHING, return the columns, ordered by aggregate and version).
         *
         * lock_unordered (OUTBOX_ORDERING=none): every row of the window.
         *
         * lock_runs (the guard): a row of the window is ready when every
         * unpublished version of its aggregate below it is in the window too:
         * per aggregate, nothing unpublished below the window's lowest
         * version (`behind`), and the lowest unpublished version between its
         * lowest and highest that the window lacks (`missing`, probed only
         * when the window holds more than one version: rows of the same
         * version never hold each other back) bounds what
         * may go. A run of consecutive versions of a busy
         * aggregate thus goes in one batch, and nothing goes while an earlier
         * version is in flight, backing off, DEAD or held by another relay.
         * The cost follows the window, not the backlog.
         *
         * lock_heads (the classic guard, for rows the window could not
         * reach): rows that are the lowest unpublished version of their
         * aggregate. Its scan steps over blocked rows, so the relay runs it
         * only to top up a short batch.
         *
         * The guards are scalar subqueries on purpose: as NOT EXISTS, the
         * planner may hash-join each row with every version of its aggregate,
         * quadratic in a hot aggregate's backlog. They probe downwards from
         * the row: a blocked version finds its unpublished predecessor at
         * once, and only a real head walks past the index entries its
         * published versions left behind until VACUUM removes them.
         *
         * `vis` keeps the window's rows whose locked version the statement
         * can see, so the UPDATE may find them by ctid (a TID scan instead
         * of a primary-key descent each). FOR UPDATE locks, and returns, the
         * newest version of a row that another transaction changed after
         * this statement began; the statement cannot update that version,
         * so the row sits this batch out, and to the guard it is a version
         * the window lacks: its successors wait too. */
        static const char *const win_fmt =
                "WITH win AS MATERIALIZED ("
                " SELECT o.ctid AS tid, o.outbox_id, o.tenant_id, o.aggregate_type,"
                "  o.aggregate_id, o.aggregate_version FROM %s o"
                " WHERE o.published_at IS NULL AND o.status IN ('PENDING','FAILED')"
                "  AND o.available_at <= now()%s%s"
                " ORDER BY o.available_at, o.aggregate_version"
                " LIMIT $1 FOR UPDATE OF o SKIP LOCKED),"
                " vis AS MATERIALIZED (SELECT w.* FROM win w"
                "  WHERE EXISTS (SELECT 1 FROM %s c WHERE c.ctid = w.tid))";
        static const char *const head_guard =
                " AND (SELECT p.aggregate_version FROM %s p"
                "  WHERE p.tenant_id = o.tenant_id AND p.aggregate_type = o.aggregate_type"
                "  AND p.aggregate_id = o.aggregate_id AND p.published_at IS NULL"
                "  AND p.aggregate_version < o.aggregate_version"
                "  ORDER BY p.aggregate_version DESC LIMIT 1) IS NULL";
        static const char *const runs_fmt =
                ", agg AS (SELECT tenant_id, aggregate_type, aggregate_id,"
                "  min(aggregate_version) AS lo, max(aggregate_version) AS top"
                "  FROM vis GROUP BY 1, 2, 3),"
                " gap AS MATERIALIZED (SELECT a.tenant_id, a.aggregate_type, a.aggregate_id,"
                "  (SELECT p.aggregate_version FROM %s p"
                "   WHERE p.tenant_id = a.tenant_id AND p.aggregate_type = a.aggregate_type"
                "   AND p.aggregate_id = a.aggregate_id AND p.aggregate_version < a.lo"
                "   AND p.published_at IS NULL"
                "   ORDER BY p.aggregate_version DESC LIMIT 1) AS behind,"
                "  CASE WHEN a.lo < a.top THEN (SELECT p.aggregate_version FROM %s p"
                "   WHERE p.tenant_id = a.tenant_id AND p.aggregate_type = a.aggregate_type"
                "   AND p.aggregate_id = a.aggregate_id"
                "   AND p.aggregate_version BETWEEN a.lo AND a.top"
                "   AND p.published_at IS NULL"
                "   AND p.outbox_id NOT IN (SELECT outbox_id FROM vis)"
                "   ORDER BY p.aggregate_version LIMIT 1) END AS missing"
                "  FROM agg a),"
                " ready AS (SELECT w.tid, w.outbox_id FROM vis w JOIN gap g"
                "  ON g.tenant_id = w.tenant_id AND g.aggregate_type = w.aggregate_type"
                "  AND g.aggregate_id = w.aggregate_id"
                "  WHERE g.behind IS NULL"
                "  AND (g.missing IS NULL OR w.aggregate_version < g.missing))";
        static const char *const tail_fmt =
                ", locked AS ("
                " UPDATE %s o SET status = 'PUBLISHING', locked_by = $2,"
                "  locked_at = now(), last_attempt_at = now(),"
                "  attempt_count = o.attempt_count + 1, updated_at = clock_timestamp()"
                " FROM %s r WHERE o.ctid = r.tid AND o.outbox_id = r.outbox_id"
                " RETURNING %s)"
                " SELECT * FROM locked ORDER BY 2, 3, 4, 5";
        static const char *const names[] = {"lock_unordered", "lock_runs", "lock_heads"};
        char delay[64] = "";
#ifdef OUTBOX_TEST_HOOKS
        /* Test hook (tests/fault/test_lock_race.py; only in builds with
         * -DOUTBOX_TEST_HOOKS=ON): a pause between the statement's start and
         * its row locks, so a test can change a row in between. */
        int delay_ms = test_hook_ms("OUTBOX_TEST_LOCK_DELAY_MS");
        if (delay_ms) {
                snprintf(delay, sizeof delay, " AND (SELECT true FROM pg_sleep(%d / 1000.0))",
                         delay_ms);
                log_warn("db", "test hook: every lock statement pauses", "ms=%d", delay_ms);
        }
#endif
        for (int v = 0; v < 3; v++) {
                struct buf guard = {0};
                buf_reset(&sql);
                int bad = v == 2 && buf_appendf(&guard, head_guard, t);
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wformat-nonliteral"
                bad = bad || buf_appendf(&sql, win_fmt, t, delay, v == 2 ? guard.data : "", t) ||
                      (v == 1 && buf_appendf(&sql, runs_fmt, t, t)) ||
                      buf_appendf(&sql, tail_fmt, t, v == 1 ? "ready" : "vis", lock_columns);
#pragma GCC diagnostic pop
                buf_free(&guard);
                if (bad)
                        goto oom;
                if (prepare(db, names[v], sql.data, 2, errstr, size))
                        goto out;
        }

        for (size_t i = 0; i < sizeof table_stmts / sizeof table_stmts[0]; i++) {
                buf_reset(&sql);
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wformat-nonliteral"
                int bad = buf_appendf(&sql, table_stmts[i].fmt, t);
#pragma GCC diagnostic pop
                if (bad)
                        goto oom;
                if (prepare(db, table_stmts[i].name, sql.data, table_stmts[i].nparams, errstr,
                            size))
                        goto out;
        }
        rc = 0;
        goto out;
oom:
        rc = errstr_set(errstr, size, "out of memory");
out:
        buf_free(&sql);
        return rc;
}

/* Messages the server sends outside a statement go to the log, not to
 * libpq's default of stderr. A FATAL one ("terminating connection due to
 * administrator command") means the server closes the connection: nothing
 * sent on it after that runs. */
static void on_notice(void *arg, const PGresult *res) {
        struct db *db = arg;
        const char *sev = PQresultErrorField(res, PG_DIAG_SEVERITY_NONLOCALIZED);
        char text[512];
        snprintf(text, sizeof text, "%s", PQresultErrorMessage(res));
        text[strcspn(text, "\n")] = '\0';
        if (sev && (strcmp(sev, "FATAL") == 0 || strcmp(sev, "PANIC") == 0))
                db->closing = 1;
        log_warn("db", "server message", "text=%s", text);
}

int db_connect(struct db *db, char *errstr, size_t errstr_size) {
        /* A half-dead connection must fail within about a minute, not the
         * kernel's default quarter of an hour: keepalives and a TCP user
         * timeout. The URL comes last, so its own settings win. */
        const char *keys[] = {
                "application_name", "connect_timeout",  "keepalives_idle", "keepalives_interval",
                "keepalives_count", "tcp_user_timeout", "dbname",          NULL};
        const char *vals[] = {"outbox-relay", "10", "30", "10", "3", "60000", db->url, NULL};
        const char *param[1] = {db->table};
        PGresult *r = NULL;
        char *nsp = NULL, *rel = NULL;
        int rc = -1;

        db_disconnect(db);
        db->conn = PQconnectdbParams(keys, vals, 1);
        if (!db->conn)
                return errstr_set(errstr, errstr_size, "out of memory");
        if (PQstatus(db->conn) != CONNECTION_OK) {
                errstr_set(errstr, errstr_size, "connect: %s", PQerrorMessage(db->conn));
                db_conninfo_scrub(db->url, errstr); /* should libpq ever quote a secret */
                goto out;
        }
        PQsetNoticeReceiver(db->conn, on_notice, db);

        r = PQexecParams(db->conn,
                         "SELECT n.nspname, c.relname FROM pg_class c"
                         " JOIN pg_namespace n ON n.oid = c.relnamespace"
                         " WHERE c.oid = to_regclass($1)",
                         1, NULL, param, NULL, NULL, 0);
        if (PQresultStatus(r) != PGRES_TUPLES_OK) {
                errstr_set(errstr, errstr_size, "resolve table: %s", PQerrorMessage(db->conn));
                goto out;
        }
        if (PQntuples(r) != 1) {
                errstr_set(errstr, errstr_size,
                           "table %s does not exist (apply schemas/postgres/*.sql first)",
                           db->table);
                goto out;
        }
        nsp = PQescapeIdentifier(db->conn, PQgetvalue(r, 0, 0), strlen(PQgetvalue(r, 0, 0)));
        rel = PQescapeIdentifier(db->conn, PQgetvalue(r, 0, 1), strlen(PQgetvalue(r, 0, 1)));
        size_t qlen = (nsp ? strlen(nsp) : 0) + (rel ? strlen(rel) : 0) + 2;
        size_t clen = strlen(PQgetvalue(r, 0, 0)) + strlen(PQgetvalue(r, 0, 1)) + 2;
        db->qtable = malloc(qlen);
        db->channel = malloc(clen);
        if (!nsp || !rel || !db->qtable || !db->channel) {
                errstr_set(errstr, errstr_size, "out of memory");
                goto out;
        }
        snprintf(db->qtable, qlen, "%s.%s", nsp, rel);
        snprintf(db->channel, clen, "%s.%s", PQgetvalue(r, 0, 0), PQgetvalue(r, 0, 1));
        if (strlen(db->channel) > 63)
                db->channel[63] = '\0'; /* as the trigger's left(..., 63) */

        {
                char *qchan = PQescapeIdentifier(db->conn, db->channel, strlen(db->channel));
                char listen[300];
                if (!qchan) {
                        errstr_set(errstr, errstr_size, "out of memory");
                        goto out;
                }
                snprintf(listen, sizeof listen, "LISTEN %s", qchan);
                PQfreemem(qchan);
                if (exec_simple(db, listen, errstr, errstr_size))
                        goto out;
        }
        /* JIT compiling the lock statements costs more than running them
         * (hundreds of ms on a hot aggregate's backlog). */
        if (exec_simple(db, "SET jit = off", errstr, errstr_size))
                goto out;
        if (prepare_all(db, errstr, errstr_size))
                goto out;
        db->connects++;
        rc = 0;
out:
        PQclear(r);
        if (nsp)
                PQfreemem(nsp);
        if (rel)
                PQfreemem(rel);
        if (rc)
                db_disconnect(db);
        return rc;
}

/* Sends one lock statement without waiting for it. A connection the server
 * already closed, or said it is closing (what has arrived is read first), is
 * dropped without sending: the statement is known not to have run. */
static int send_lock(struct db *db, const char *stmt, int limit, char *errstr, size_t size) {
        char lim[16];
        const char *params[2] = {lim, db->relay_id};
        snprintf(lim, sizeof lim, "%d", limit);
        if (!PQconsumeInput(db->conn) || PQstatus(db->conn) != CONNECTION_OK || db->closing) {
                errstr_set(errstr, size, "%s: not sent: %s", stmt,
                           db->closing ? "the server is closing the connection"
                                       : PQerrorMessage(db->conn));
                db_disconnect(db);
                return -1;
        }
        if (!PQsendQueryPrepared(db->conn, stmt, 2, params, NULL, NULL, 0)) {
                errstr_set(errstr, size, "%s: %s", stmt, PQerrorMessage(db->conn));
                check_conn(db);
                return -1;
        }
        return 0;
}

/* Waits for the result of the lock statement sent last (NULL with errstr set).
 * An error after the rows (the statement commits at its end, and may fail
 * there, or the connection may be lost before) wins, as in PQexecPrepared(). */
static PGresult *get_lock(struct db *db, const char *stmt, char *errstr, size_t size) {
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
                errstr_set(errstr, size, "%s: %s", stmt, PQerrorMessage(db->conn));
                /* An error the server sent (it has a SQLSTATE: a statement
                 * error, a commit that failed, a backend terminated by an
                 * administrator or a shutdown) rolled the statement back. A
                 * connection lost without one leaves its outcome unknown. */
                db->locks_unknown |= PQstatus(db->conn) != CONNECTION_OK &&
                                     !PQresultErrorField(r, PG_DIAG_SQLSTATE) && !db->closing;
                PQclear(r);
                check_conn(db);
                return NULL;
        }
        return r;
}

/* Runs one lock statement and waits for it (NULL with errstr set). */
static PGresult *run_lock(struct db *db, const char *stmt, int limit, char *errstr, size_t size) {
        return send_lock(db, stmt, limit, errstr, size) == 0 ? get_lock(db, stmt, errstr, size)
                                                             : NULL;
}

/* The window lock statement: with the per-aggregate guard, or without. */
static const char *window_lock(int ordering_aggregate) {
        return ordering_aggregate ? "lock_runs" : "lock_unordered";
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

/* Points events at the rows of r. */
static void fill_events(PGresult *r, struct outbox_event *events) {
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
        }
#undef V
#undef S
}

/* The results behind a batch: the lock statement's, a top-up's, and
 * db_lock_more()'s. */
#define BATCH_RESULTS_MAX 3
struct batch_results {
        PGresult *r[BATCH_RESULTS_MAX];
        int n;
};

int db_lock_send(struct db *db, int limit, int ordering_aggregate, int top_up, char *errstr,
                 size_t errstr_size) {
        if (!db_connected(db))
                return errstr_set(errstr, errstr_size, "not connected");
        if (db->lock_sent)
                return errstr_set(errstr, errstr_size, "a lock statement is in flight");
        const char *stmt = window_lock(ordering_aggregate);
        if (send_lock(db, stmt, limit, errstr, errstr_size) != 0)
                return -1;
        db->lock_sent = stmt;
        db->lock_limit = limit;
        db->lock_top_up = ordering_aggregate && top_up;
        return 0;
}

int db_lock_receive(struct db *db, struct db_batch *out, char *errstr, size_t errstr_size) {
        struct batch_results *br = NULL;
        const char *stmt = db->lock_sent;
        memset(out, 0, sizeof *out);
        if (!stmt)
                return errstr_set(errstr, errstr_size, "no lock statement in flight");
        db->lock_sent = NULL;
        if (!db_connected(db))
                return errstr_set(errstr, errstr_size, "not connected");
        br = calloc(1, sizeof *br);
        if (!br) {
                /* the statement's result must still be read off the wire */
                PGresult *r;
                while ((r = PQgetResult(db->conn)) != NULL)
                        PQclear(r);
                db->locks_unknown = 1;
                return errstr_set(errstr, errstr_size, "out of memory");
        }
        br->r[0] = get_lock(db, stmt, errstr, errstr_size);
        if (!br->r[0])
                goto fail;
        int limit = db->lock_limit, n0 = PQntuples(br->r[0]);
        /* A short batch under the guard: the window may have been full of
         * blocked versions, with heads of other aggregates behind them. Top
         * it up with the classic guard; after a top-up that found nothing,
         * not again for a second (its scan steps over every blocked row). */
        if (db->lock_top_up && n0 < limit && clock_mono_s() >= db->topup_after) {
                if (!(br->r[1] = run_lock(db, "lock_heads", limit - n0, errstr, errstr_size))) {
                        db->locks_unknown = 1; /* r[0]'s rows stay PUBLISHING */
                        goto fail;
                }
                if (PQntuples(br->r[1]) == 0)
                        db->topup_after = clock_mono_s() + 1.0;
        }
        size_t n = (size_t)n0 + (size_t)(br->r[1] ? PQntuples(br->r[1]) : 0);
        if (n == 0) {
                PQclear(br->r[0]);
                PQclear(br->r[1]);
                free(br);
                return 0;
        }
        out->events = calloc(n, sizeof *out->events);
        if (!out->events) {
                errstr_set(errstr, errstr_size, "out of memory for %zu rows", n);
                db->locks_unknown = 1; /* the rows stay PUBLISHING */
                goto fail;
        }
        /* The two sets hold different aggregates (a run's aggregate has its
         * head locked, so lock_heads cannot take it): each aggregate's rows
         * stay together, in version order. */
        fill_events(br->r[0], out->events);
        if (br->r[1])
                fill_events(br->r[1], out->events + n0);
        br->n = br->r[1] ? 2 : 1;
        out->count = n;
        out->priv = br;
        return 0;
fail:
        PQclear(br->r[0]);
        PQclear(br->r[1]);
        free(br);
        return -1;
}

int db_lock_batch(struct db *db, int limit, int ordering_aggregate, struct db_batch *out,
                  char *errstr, size_t errstr_size) {
        memset(out, 0, sizeof *out);
        if (db_lock_send(db, limit, ordering_aggregate, 1, errstr, errstr_size) != 0)
                return -1;
        return db_lock_receive(db, out, errstr, errstr_size);
}

int db_lock_more(struct db *db, int limit, int ordering_aggregate, struct db_batch *b, char *errstr,
                 size_t errstr_size) {
        struct batch_results *br = b->priv;
        if (!br || br->n == BATCH_RESULTS_MAX || limit <= 0)
                return 0;
        if (!db_connected(db))
                return errstr_set(errstr, errstr_size, "not connected");
        PGresult *r = run_lock(db, window_lock(ordering_aggregate), limit, errstr, errstr_size);
        if (!r)
                return -1;
        size_t add = (size_t)PQntuples(r);
        struct outbox_event *ev =
                add ? realloc(b->events, (b->count + add) * sizeof *b->events) : NULL;
        if (!ev) {
                PQclear(r);
                if (!add)
                        return 0;
                db->locks_unknown = 1; /* the rows it locked stay PUBLISHING */
                return errstr_set(errstr, errstr_size, "out of memory for %zu rows", add);
        }
        /* the events point into the results, which stay where they are */
        b->events = ev;
        fill_events(r, ev + b->count);
        b->count += add;
        br->r[br->n++] = r;
        return 0;
}

int db_locks_unknown(const struct db *db) {
        return db->locks_unknown;
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
                check_conn(db);
        }
}

/* Runs a mark statement; adds affected rows to *done. */
static int run_mark(struct db *db, const char *stmt, int nparams, const char *const *params,
                    long long *done, char *errstr, size_t size) {
        PGresult *r = PQexecPrepared(db->conn, stmt, nparams, params, NULL, NULL, 0);
        if (PQresultStatus(r) != PGRES_COMMAND_OK) {
                errstr_set(errstr, size, "%s: %s", stmt, PQerrorMessage(db->conn));
                PQclear(r);
                check_conn(db);
                return -1;
        }
        *done += strtoll(PQcmdTuples(r), NULL, 10);
        PQclear(r);
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
        for (int status = DB_PUBLISHED; status <= DB_RELEASED; status++) {
                size_t cnt = 0;
                for (int k = 0; k < A_COUNT; k++) {
                        buf_reset(&a[k]);
                        if (buf_append(&a[k], "{", 1))
                                goto oom;
                }
                for (size_t i = 0; i < n; i++) {
                        if ((int)outs[i].status != status || outs[i].marked)
                                continue;
                        cnt++;
                        if (array_elem(&a[A_IDS], outs[i].outbox_id) ||
                            (status == DB_PUBLISHED && array_elem(&a[A_TIDS], outs[i].tid)))
                                goto oom;
                        if (status != DB_FAILED && status != DB_DEAD)
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
                if (status == DB_PUBLISHED) {
                        /* By ctid, then by outbox_id for rows an update moved
                         * since the lock: one transaction, so a failure in
                         * between leaves nothing half marked (which a retry
                         * would count as lost locks). */
                        const char *p[3] = {a[A_IDS].data, db->relay_id, a[A_TIDS].data};
                        long long by_tid = 0, by_id = 0;
                        if (exec_simple(db, "BEGIN", errstr, errstr_size) ||
                            run_mark(db, "mark_published", 3, p, &by_tid, errstr, errstr_size) ||
                            (by_tid < (long long)cnt && run_mark(db, "mark_published_id", 2, p,
                                                                 &by_id, errstr, errstr_size)) ||
                            exec_simple(db, "COMMIT", errstr, errstr_size)) {
                                abort_tx(db);
                                goto out;
                        }
                        done += by_tid + by_id;
                } else if (status == DB_RELEASED) {
                        const char *p[2] = {a[A_IDS].data, db->relay_id};
                        if (run_mark(db, "mark_released", 2, p, &done, errstr, errstr_size))
                                goto out;
                } else {
                        const char *p[7] = {status == DB_FAILED ? "FAILED" : "DEAD",
                                            a[A_IDS].data,
                                            a[A_DELAYS].data,
                                            a[A_CODES].data,
                                            a[A_MSGS].data,
                                            db->relay_id,
                                            a[A_UNCOUNTS].data};
                        if (run_mark(db, "mark_unpublished", 7, p, &done, errstr, errstr_size))
                                goto out;
                }
                for (size_t i = 0; i < n; i++)
                        if ((int)outs[i].status == status)
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

/* Frees pending notifications; returns how many there were. */
static int drain_notifies(struct db *db) {
        int n = 0;
        PGnotify *nt;
        while ((nt = PQnotifies(db->conn)) != NULL) {
                PQfreemem(nt);
                n++;
        }
        return n;
}

int db_wait(struct db *db, int timeout_ms) {
        if (!db_connected(db))
                return -1;
        if (!PQconsumeInput(db->conn)) {
                db_disconnect(db);
                return -1;
        }
        if (drain_notifies(db))
                return 1;
        int fd = PQsocket(db->conn);
        if (fd < 0) {
                db_disconnect(db);
                return -1;
        }
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        int s = poll(&pfd, 1, timeout_ms);
        if (s < 0)
                return errno == EINTR ? 0 : -1;
        if (s == 0)
                return 0;
        if (!PQconsumeInput(db->conn)) {
                db_disconnect(db);
                return -1;
        }
        return drain_notifies(db) ? 1 : 0;
}

/* Runs a row-count statement: `sql_fmt` names the table as %1$s (as often as
 * it needs) and takes $1 .. $nparams (at most 2) from p1, p2; *n gets the
 * rows affected. */
static int exec_count(struct db *db, const char *what, const char *sql_fmt, int nparams,
                      long long p1, long long p2, long long *n, char *errstr, size_t size) {
        struct buf sql = {0};
        char a[24], b[24];
        const char *params[2] = {a, b};
        int rc = -1;
        *n = 0;
        if (!db_connected(db))
                return errstr_set(errstr, size, "not connected");
        snprintf(a, sizeof a, "%lld", p1);
        snprintf(b, sizeof b, "%lld", p2);
        /* the format is one of this file's literals, naming only %1$s */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wformat-nonliteral"
        int built = buf_appendf(&sql, sql_fmt, db->qtable);
#pragma GCC diagnostic pop
        if (built != 0) {
                errstr_set(errstr, size, "out of memory");
                goto out;
        }
        PGresult *r = PQexecParams(db->conn, sql.data, nparams, NULL, params, NULL, NULL, 0);
        if (PQresultStatus(r) != PGRES_COMMAND_OK) {
                errstr_set(errstr, size, "%s: %s", what, PQerrorMessage(db->conn));
                PQclear(r);
                check_conn(db);
                goto out;
        }
        *n = strtoll(PQcmdTuples(r), NULL, 10);
        PQclear(r);
        rc = 0;
out:
        buf_free(&sql);
        return rc;
}

int db_reset_stale(struct db *db, int lock_timeout_s, int limit, long long *n, char *errstr,
                   size_t errstr_size) {
        return exec_count(db, "reset stale locks",
                          "WITH stale AS (SELECT outbox_id FROM %1$s"
                          " WHERE published_at IS NULL"
                          " AND available_at < now() - $1 * interval '1 second'"
                          " AND status = 'PUBLISHING'"
                          " AND locked_at < now() - $1 * interval '1 second'"
                          " ORDER BY available_at, aggregate_version"
                          " LIMIT $2 FOR UPDATE SKIP LOCKED)"
                          " UPDATE %1$s o SET status = 'FAILED', available_at = now(),"
                          " last_error_code = 'STALE_LOCK',"
                          " last_error_message = 'lock of ' || coalesce(o.locked_by, '?')"
                          "  || ' expired after ' || $1 || ' s',"
                          " locked_by = NULL, locked_at = NULL, updated_at = clock_timestamp()"
                          " FROM stale WHERE o.outbox_id = stale.outbox_id",
                          2, lock_timeout_s, limit, n, errstr, errstr_size);
}

int db_delete_published(struct db *db, long long retention_s, int limit, long long *n, char *errstr,
                        size_t errstr_size) {
        return exec_count(db, "delete published",
                          "DELETE FROM %1$s WHERE outbox_id IN (SELECT outbox_id FROM %1$s"
                          " WHERE published_at IS NOT NULL"
                          " AND published_at < now() - $1 * interval '1 second'"
                          " ORDER BY published_at LIMIT $2 FOR UPDATE SKIP LOCKED)",
                          2, retention_s, limit, n, errstr, errstr_size);
}

/* Parking (docs/contract-changes.md): a PENDING or FAILED version behind a
 * DEAD one of its aggregate can never go before an operator acts, yet it is
 * due, so every lock would step over it. It is parked out of the lock scan's
 * range (available_at 'infinity', code BLOCKED) while its aggregate has a
 * DEAD version below it. Each statement reads the parked range of the due
 * index (DEAD and parked rows) once; parking then walks each DEAD
 * aggregate's versions in order from above the highest one already parked,
 * so a long queue is parked in one pass over it, not re-read by every
 * statement. (A version a relay's lock statement held at that moment, SKIP
 * LOCKED, stays due behind the parked ones: blocked as before, one row.) */
int db_park_blocked(struct db *db, int limit, long long *n, char *errstr, size_t errstr_size) {
        return exec_count(
                db, "park blocked versions",
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
                "   AND s.aggregate_type = d.aggregate_type AND s.aggregate_id = d.aggregate_id"
                "   AND s.published_at IS NULL AND s.aggregate_version > greatest(d.v, d.parked)"
                "   AND s.status IN ('PENDING', 'FAILED') AND s.available_at <> 'infinity'"
                "   ORDER BY s.aggregate_version LIMIT $1 FOR UPDATE SKIP LOCKED) x LIMIT $1))"
                " AND o.status IN ('PENDING', 'FAILED')",
                1, limit, 0, n, errstr, errstr_size);
}

/* Puts parked versions back in the lock scan's range (due now) once no DEAD
 * version of their aggregate is below them, or, with `all`
 * (OUTBOX_ORDERING=none, where nothing blocks), every parked version. */
int db_unpark_blocked(struct db *db, int all, int limit, long long *n, char *errstr,
                      size_t errstr_size) {
        /* One sort of the parked range gives each row the lowest DEAD
         * version of its aggregate. Both statements hand the rows to the
         * UPDATE as an array, found by primary key: no join whose plan a
         * misestimate could turn quadratic. */
        return exec_count(
                db, "unpark versions",
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
                " AND o.status IN ('PENDING', 'FAILED')",
                2, limit, all ? 1 : 0, n, errstr, errstr_size);
}

int db_sample(struct db *db, double counts[DB_STATUS_COUNT], double *oldest_age_s, char *errstr,
              size_t errstr_size) {
        struct buf sql = {0};
        int rc = -1;
        if (!db_connected(db))
                return errstr_set(errstr, errstr_size, "not connected");
#ifdef OUTBOX_TEST_HOOKS
        /* Test hook (tests/fault/test_sampling.py; only in builds with
         * -DOUTBOX_TEST_HOOKS=ON): a sample as slow as a large backlog makes it. */
        int delay_ms = test_hook_ms("OUTBOX_TEST_SAMPLE_DELAY_MS");
        if (delay_ms) {
                char sleep_sql[64];
                snprintf(sleep_sql, sizeof sleep_sql, "SELECT pg_sleep(%d / 1000.0)", delay_ms);
                PQclear(PQexec(db->conn, sleep_sql));
        }
#endif
        /* Exact counts over unpublished rows (the partial index's predicate);
         * PUBLISHED, which may be millions of rows, from the statistics
         * collector's live-row count (approximate, never a table scan). */
        if (buf_appendf(&sql,
                        "SELECT count(*) FILTER (WHERE status = 'PENDING'),"
                        " count(*) FILTER (WHERE status = 'PUBLISHING'),"
                        " greatest(coalesce((SELECT n_live_tup FROM pg_stat_user_tables"
                        "  WHERE relid = '%s'::regclass), 0) - count(*), 0)::float8,"
                        " count(*) FILTER (WHERE status = 'FAILED'),"
                        " count(*) FILTER (WHERE status = 'DEAD'),"
                        " coalesce(extract(epoch FROM now() - min(created_at)"
                        "  FILTER (WHERE status IN ('PENDING', 'FAILED'))), 0)::float8"
                        " FROM %s WHERE published_at IS NULL",
                        db->qtable, db->qtable))
                return errstr_set(errstr, errstr_size, "out of memory");
        PGresult *r = PQexec(db->conn, sql.data);
        if (PQresultStatus(r) != PGRES_TUPLES_OK || PQntuples(r) != 1) {
                errstr_set(errstr, errstr_size, "sample: %s", PQerrorMessage(db->conn));
                check_conn(db);
        } else {
                for (int i = 0; i < DB_STATUS_COUNT; i++)
                        counts[i] = strtod(PQgetvalue(r, 0, i), NULL);
                *oldest_age_s = strtod(PQgetvalue(r, 0, DB_STATUS_COUNT), NULL);
                rc = 0;
        }
        PQclear(r);
        buf_free(&sql);
        return rc;
}

void db_destroy(struct db *db) {
        if (!db)
                return;
        db_disconnect(db);
        free(db->url);
        free(db->table);
        free(db->relay_id);
        free(db);
}

long db_connects(const struct db *db) {
        return db->connects;
}

int db_backend_pid(const struct db *db) {
        return db->conn ? PQbackendPID(db->conn) : 0;
}

int db_take_back_own(struct db *db, int max_attempts, long long *n, char *errstr,
                     size_t errstr_size) {
        char m[24];
        const char *params[2] = {db->relay_id, m};
        *n = 0;
        if (!db_connected(db))
                return errstr_set(errstr, errstr_size, "not connected");
        snprintf(m, sizeof m, "%d", max_attempts);
        PGresult *r = PQexecPrepared(db->conn, "take_back_own", 2, params, NULL, NULL, 0);
        if (PQresultStatus(r) != PGRES_COMMAND_OK) {
                errstr_set(errstr, errstr_size, "take back own locks: %s",
                           PQerrorMessage(db->conn));
                PQclear(r);
                check_conn(db);
                return -1;
        }
        *n = strtoll(PQcmdTuples(r), NULL, 10);
        PQclear(r);
        db->locks_unknown = 0;
        return 0;
}
