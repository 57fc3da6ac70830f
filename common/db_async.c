/* db_async.c - a connection driven by the caller's poll() loop: connect,
 * set the session up, run one statement at a time, take NOTIFY, never
 * block (libpq's asynchronous API in non-blocking mode). */
#include "db_async.h"

#include <ctype.h>
#include <stddef.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "db_conninfo.h"
#include "db_internal.h"
#include "db_version.h"
#include "encode.h"
#include "errstr.h"
#include "log.h"

/* A connect (TCP, TLS, authentication, the session's set-up) that takes
 * longer than this is given up. */
#define CONNECT_TIMEOUT_S 10.0
struct db_result {
        PGresult *r; /* NULL when the connection broke before an answer */
        char sqlstate[6];
        char error[512];
};

/* The set-up steps after the connection is made, in order: three round
 * trips. */
/* Set-up steps cancelled by a database's tiny statement timeout are sent
 * again this many times in all at most. */
#define SETUP_TIMEOUT_TRIES 5

enum setup {
        SETUP_NONE = 0,
        SETUP_TIMEOUT,    /* the statement timeout, alone */
        SETUP_SESSION,    /* SETs, then the table's name, the server's clock and version */
        SETUP_STATEMENTS, /* LISTEN and every PREPARE, in one pipeline */
        SETUP_DONE
};

/* PostgreSQL's longest identifier, and so NOTIFY channel name. */
#define CHANNEL_MAX 63

void db_disconnect(struct db *db) {
        if (db->conn)
                PQfinish(db->conn);
        db->conn = NULL;
        db->closing = 0;
        db->phase = DB_DOWN;
        db->setup = 0;
        db->want_write = 0;
        db->running = NULL;
        PQclear(db->pending);
        db->pending = NULL;
        free(db->qtable);
        free(db->channel);
        free(db->topic_expr);
        db->qtable = db->channel = db->topic_expr = NULL;
        db->admin_temp = 0; /* temp tables go with the session */
        buf_free(&db->copy);
}

void db_channel_name(const char *schema, const char *name, char *out) {
        char whole[2 * (CHANNEL_MAX + 1)]; /* each part is an identifier */
        snprintf(whole, sizeof whole, "%s.%s", schema, name);
        size_t n = encode_utf8_prefix(whole, CHANNEL_MAX);
        memcpy(out, whole, n);
        out[n] = '\0';
}

int db_set_table(struct db *db, const char *schema, const char *name, char *errstr, size_t size) {
        char *nsp = PQescapeIdentifier(db->conn, schema, strlen(schema));
        char *rel = PQescapeIdentifier(db->conn, name, strlen(name));
        size_t qlen = (nsp ? strlen(nsp) : 0) + (rel ? strlen(rel) : 0) + 2;
        int rc = -1;
        free(db->qtable);
        free(db->channel);
        db->qtable = malloc(qlen);
        db->channel = malloc(CHANNEL_MAX + 1);
        if (!nsp || !rel || !db->qtable || !db->channel) {
                errstr_set(errstr, size, "out of memory");
                goto out;
        }
        snprintf(db->qtable, qlen, "%s.%s", nsp, rel);
        db_channel_name(schema, name, db->channel);
        rc = 0;
out:
        if (nsp)
                PQfreemem(nsp);
        if (rel)
                PQfreemem(rel);
        return rc;
}

int db_async_configure(struct db *db, const struct db_session *s) {
        char *app = strdup(s->app_name ? s->app_name : "outbox-relay");
        if (!app)
                return -1;
        free(db->session_app);
        db->session = *s;
        db->session_app = app;
        db->session.app_name = app;
        return 0;
}

enum db_phase db_async_phase(const struct db *db) {
        return db->phase;
}

double db_async_deadline(const struct db *db) {
        return db->phase == DB_CONNECTING ? db->connect_deadline : 0;
}

const char *db_async_connected_at(const struct db *db) {
        return db->connected_at;
}

void db_async_close(struct db *db) {
        db_disconnect(db);
}

int db_async_start(struct db *db, double now, char *errstr, size_t errstr_size) {
        const char *keys[8], *vals[8];
        size_t n = 0;
        db_async_close(db);
        /* what the last attempt failed on: a failure of this one, even
         * before its first round trip, must not read as that */
        db->table_missing = db->too_old = db->table_locked = 0;
        /* A half-dead connection fails within about a minute, not the
         * kernel's quarter of an hour: keepalives and a TCP user timeout.
         * The URL comes last, so its own settings win. */
        keys[n] = "application_name", vals[n++] = db->session.app_name;
        keys[n] = "keepalives_idle", vals[n++] = "30";
        keys[n] = "keepalives_interval", vals[n++] = "10";
        keys[n] = "keepalives_count", vals[n++] = "3";
        keys[n] = "tcp_user_timeout", vals[n++] = "60000";
        keys[n] = "dbname", vals[n++] = db->url;
        keys[n] = vals[n] = NULL;
        db->conn = PQconnectStartParams(keys, vals, 1);
        if (!db->conn)
                return errstr_set(errstr, errstr_size, "out of memory");
        if (PQstatus(db->conn) == CONNECTION_BAD) {
                errstr_set(errstr, errstr_size, "connect: %s", PQerrorMessage(db->conn));
                db_conninfo_scrub(db->url, errstr);
                db_async_close(db);
                return -1;
        }
        db->phase = DB_CONNECTING;
        db->connect_polling = PGRES_POLLING_WRITING;
        db->connect_deadline = now + CONNECT_TIMEOUT_S;
        return 0;
}

int db_async_fd(const struct db *db, short *events) {
        if (db->phase == DB_DOWN || !db->conn)
                return -1;
        int fd = PQsocket(db->conn);
        if (fd < 0)
                return -1;
        if (db->phase == DB_CONNECTING && db->setup == SETUP_NONE)
                *events = db->connect_polling == PGRES_POLLING_READING ? POLLIN : POLLOUT;
        else
                *events = (short)(POLLIN | (db->want_write ? POLLOUT : 0));
        return fd;
}

/* Sends what libpq holds back (non-blocking mode); -1 on a broken socket. */
static int flush(struct db *db) {
        int f = PQflush(db->conn);
        if (f < 0)
                return -1;
        db->want_write = f == 1;
        return 0;
}

/* The test hooks' markers in the statements, and what each stands for in
 * builds with test hooks when its setting is not 0 (nothing in other
 * builds): a predicate, true, that sleeps the setting's milliseconds or, on
 * a row `o` of the setting's version, fails (a data exception, 22012; for a
 * negative setting -N, on version N, an unknown setting's 42704) or ends
 * the session (its server process terminates itself). */
static const struct {
        const char *text;
        size_t off;
        const char *before, *after; /* the predicate: before, the setting, after */
} markers[] = {
        {"/* test: lock pause */", offsetof(struct db_session, test_lock_delay_ms),
         " AND (SELECT true FROM pg_sleep(", " / 1000.0))"},
        {"/* test: mark pause */", offsetof(struct db_session, test_mark_delay_ms),
         " AND (SELECT true FROM pg_sleep(", " / 1000.0))"},
        {"/* test: sample pause */", offsetof(struct db_session, test_sample_delay_ms),
         " AND (SELECT true FROM pg_sleep(", " / 1000.0))"},
        {"/* test: fetch fault */", offsetof(struct db_session, test_fetch_fault_version),
         " AND (SELECT CASE WHEN f.n > 0 THEN 1 / (o.aggregate_version - f.n)"
         " WHEN o.aggregate_version = -f.n THEN current_setting('outbox.test_fetch_fault')::bigint"
         " ELSE 1 END FROM (SELECT ",
         "::bigint AS n) f) IS NOT NULL"},
        {"/* test: fetch kill */", offsetof(struct db_session, test_fetch_kill_version),
         " AND (o.aggregate_version <> ", " OR pg_terminate_backend(pg_backend_pid()))"},
};

/* The marker p starts with (its length into *len), or -1. */
static int marker_at(const char *p, size_t *len) {
        for (size_t i = 0; i < sizeof markers / sizeof markers[0]; i++) {
                size_t n = strlen(markers[i].text);
                if (!strncmp(p, markers[i].text, n)) {
                        *len = n;
                        return (int)i;
                }
        }
        return -1;
}

/* Appends `sql` to out with the table's name in place of :table (quoted
 * identifiers) and :'table' (a string literal of it), and the test hooks'
 * pauses in place of their markers. */
static int expand_sql(const struct db *db, const char *sql, struct buf *out) {
        buf_reset(out);
        for (const char *p = sql; *p;) {
                size_t len;
                int m;
                if (!strncmp(p, ":'table'", 8)) {
                        if (buf_append(out, "'", 1) ||
                            buf_append(out, db->qtable, strlen(db->qtable)) ||
                            buf_append(out, "'", 1))
                                return -1;
                        p += 8;
                } else if (!strncmp(p, ":table", 6) && !isalnum((unsigned char)p[6]) &&
                           p[6] != '_') {
                        if (buf_append(out, db->qtable, strlen(db->qtable)))
                                return -1;
                        p += 6;
                } else if ((m = marker_at(p, &len)) >= 0) {
#ifdef OUTBOX_TEST_HOOKS
                        int v = *(const int *)((const char *)&db->session + markers[m].off);
                        if (v != 0 &&
                            buf_appendf(out, "%s%d%s", markers[m].before, v, markers[m].after))
                                return -1;
#endif
                        p += len;
                } else {
                        if (buf_append(out, p, 1))
                                return -1;
                        p++;
                }
        }
        return 0;
}

/* Sends the session's statement timeout, alone: a query string runs under
 * the timeout in force when it starts, parsed as a whole first, so a
 * database's tiny default (1 ms) would cancel the longer set-up below
 * before its first SET ran. Even this one can meet it on a new backend
 * (its caches cold), and the default's timer can fire as this SET ends,
 * cancelling the next query: a set-up step cancelled (57014) is sent
 * again on the same session, SETUP_TIMEOUT_TRIES times in all at most. */
static int send_timeout(struct db *db, char *errstr, size_t size) {
        db->setup_tries++;
        char q[64];
        snprintf(q, sizeof q, "SET statement_timeout = %d", db->session.statement_timeout_ms);
        if (!PQsendQuery(db->conn, q) || flush(db))
                return errstr_set(errstr, size, "session set-up: %s", PQerrorMessage(db->conn));
        return 0;
}

/* Sends the session's SETs and the table's resolution (one round trip). */
static int send_session(struct db *db, char *errstr, size_t size) {
        struct buf q = {0};
        const struct db_session *s = &db->session;
        char *lit = PQescapeLiteral(db->conn, db->table, strlen(db->table));
        int rc = -1;
        /* The isolation the statements are written for, the timeouts that
         * keep any wait short, no JIT (compiling costs more than running
         * these statements), and generic plans (planned once per session:
         * the statements' shapes do not depend on their parameters). An
         * idle transaction cannot hold rows: the daemons never leave one
         * open, so a frozen process's is ended by the server. The
         * statement timeout is in force already (send_timeout). */
        if (!lit ||
            buf_appendf(&q,
                        "SET lock_timeout = %d;"
                        " SET default_transaction_isolation = 'read committed';"
                        " SET default_transaction_read_only = off;"
                        " SET idle_in_transaction_session_timeout = %d;"
                        " SET jit = off; SET plan_cache_mode = force_generic_plan;"
                        " SET tcp_user_timeout = %d;",
                        s->lock_timeout_ms,
                        s->statement_timeout_ms > 0 ? s->statement_timeout_ms : 60000,
                        s->statement_timeout_ms > 0 ? s->statement_timeout_ms : 60000) ||
            (s->fixed_plans &&
             buf_appendf(&q, " SET enable_seqscan = off; SET enable_bitmapscan = off;"
                             " SET enable_sort = off; SET enable_hashjoin = off;"
                             " SET enable_mergejoin = off; SET enable_material = off;")) ||
            buf_appendf(&q,
                        " SELECT n.nspname, c.relname, now()::text,"
                        " current_setting('server_version_num')::int"
                        " FROM (SELECT 1) one LEFT JOIN pg_class c ON c.oid = to_regclass(%s)"
                        " LEFT JOIN pg_namespace n ON n.oid = c.relnamespace",
                        lit)) {
                errstr_set(errstr, size, "out of memory");
                goto out;
        }
        if (!PQsendQuery(db->conn, q.data) || flush(db)) {
                errstr_set(errstr, size, "session set-up: %s", PQerrorMessage(db->conn));
                goto out;
        }
        rc = 0;
out:
        if (lit)
                PQfreemem(lit);
        buf_free(&q);
        return rc;
}

static int resend_session(struct db *db, char *errstr, size_t size) {
        db->setup_tries++;
        return send_session(db, errstr, size);
}

/* Takes the table's quoted name and channel, the server's clock and version
 * from the set-up's last answer. */
static int read_session(struct db *db, PGresult *r, char *errstr, size_t size) {
        if (PQntuples(r) != 1 || PQnfields(r) != 4)
                return errstr_set(errstr, size, "session set-up: unexpected answer");
        snprintf(db->connected_at, sizeof db->connected_at, "%s", PQgetvalue(r, 0, 2));
        if (db_check_server_version(atol(PQgetvalue(r, 0, 3)), errstr, size) != 0) {
                db->too_old = 1;
                return -1;
        }
        if (PQgetisnull(r, 0, 0)) {
                db->table_missing = 1;
                return errstr_set(errstr, size,
                                  "table %s does not exist (apply schemas/postgres/*.sql first)",
                                  db->table);
        }
        return db_set_table(db, PQgetvalue(r, 0, 0), PQgetvalue(r, 0, 1), errstr, size);
}

/* Whether statement i is prepared at connect. */
static int prepared(const struct db *db, size_t i) {
        return !db->session.prepare || (i < 64 && (db->session.prepare >> i & 1));
}

/* Sends LISTEN (when asked) and every PREPARE in one pipeline (libpq's
 * pipeline mode): one round trip, whatever the number of statements. */
static int send_statements(struct db *db, char *errstr, size_t size) {
        struct buf sql = {0};
        char *chan = NULL;
        int rc = -1;
        if (!PQenterPipelineMode(db->conn)) {
                errstr_set(errstr, size, "pipeline: %s", PQerrorMessage(db->conn));
                goto out;
        }
        db->setup_next = 0; /* commands sent, to name the one that fails */
        if (db->session.listen) {
                chan = PQescapeIdentifier(db->conn, db->channel, strlen(db->channel));
                if (!chan || buf_appendf(&sql, "LISTEN %s", chan)) {
                        errstr_set(errstr, size, "out of memory");
                        goto out;
                }
                if (!PQsendQueryParams(db->conn, sql.data, 0, NULL, NULL, NULL, NULL, 0)) {
                        errstr_set(errstr, size, "listen: %s", PQerrorMessage(db->conn));
                        goto out;
                }
        }
        for (size_t i = 0; i < db->session.nsql; i++) {
                const struct db_sql *s = &db->session.sql[i];
                if (!prepared(db, i))
                        continue;
                if (expand_sql(db, s->text, &sql)) {
                        errstr_set(errstr, size, "out of memory");
                        goto out;
                }
                if (!PQsendPrepare(db->conn, s->name, sql.data, 0, NULL)) {
                        errstr_set(errstr, size, "prepare %s: %s", s->name,
                                   PQerrorMessage(db->conn));
                        goto out;
                }
        }
        if (!PQpipelineSync(db->conn) || flush(db)) {
                errstr_set(errstr, size, "prepare: %s", PQerrorMessage(db->conn));
                goto out;
        }
        rc = 0;
out:
        if (chan)
                PQfreemem(chan);
        buf_free(&sql);
        return rc;
}

/* The name of the set-up command number n of the pipeline. */
static const char *command_name(const struct db *db, size_t n) {
        if (db->session.listen) {
                if (n == 0)
                        return "listen";
                n--;
        }
        for (size_t i = 0; i < db->session.nsql; i++)
                if (prepared(db, i) && n-- == 0)
                        return db->session.sql[i].name;
        return "set-up";
}

/* Reads the pipeline's answers; 1 once its sync came (setup_error and
 * setup_why set when a command failed), 0 while more is owed, -1 when the
 * connection broke. */
static int collect_pipeline(struct db *db) {
        if (!PQconsumeInput(db->conn))
                return -1;
        while (!PQisBusy(db->conn)) {
                PGresult *r = PQgetResult(db->conn);
                if (!r) {
                        db->setup_next++; /* the end of one command's answer */
                        continue;
                }
                ExecStatusType st = PQresultStatus(r);
                if (st == PGRES_PIPELINE_SYNC) {
                        PQclear(r);
                        PQexitPipelineMode(db->conn);
                        return 1;
                }
                /* kept in db: the pipeline's end, which reports it, may
                 * come in a later call */
                if (st == PGRES_FATAL_ERROR && !db->setup_error) {
                        const char *state = PQresultErrorField(r, PG_DIAG_SQLSTATE);
                        db->setup_error = 1;
                        db->table_locked = state && !strcmp(state, "55P03");
                        snprintf(db->setup_why, sizeof db->setup_why, "%s: %s",
                                 command_name(db, db->setup_next), PQresultErrorMessage(r));
                }
                PQclear(r);
        }
        return 0;
}

/* Sends the next set-up step, or marks the session set up. */
static int next_setup(struct db *db, char *errstr, size_t size) {
        switch (db->setup) {
        case SETUP_NONE:
                db->setup = SETUP_TIMEOUT;
                db->setup_tries = 0;
                return send_timeout(db, errstr, size);
        case SETUP_TIMEOUT: db->setup = SETUP_SESSION; return send_session(db, errstr, size);
        case SETUP_SESSION:
                db->setup = SETUP_STATEMENTS;
                db->setup_error = 0;
                return send_statements(db, errstr, size);
        default: db->setup = SETUP_DONE; return 0;
        }
}

/* Messages the server sends outside a statement go to the log. A FATAL one
 * ("terminating connection due to administrator command") means the server
 * closes the connection: nothing sent on it after that runs. */
static void on_notice(void *arg, const PGresult *res) {
        struct db *db = arg;
        const char *sev = PQresultErrorField(res, PG_DIAG_SEVERITY_NONLOCALIZED);
        char text[512];
        snprintf(text, sizeof text, "%s", PQresultErrorMessage(res));
        text[strcspn(text, "\n")] = '\0';
        if (sev && (strcmp(sev, "FATAL") == 0 || strcmp(sev, "PANIC") == 0))
                db->closing = 1;
        log_warn("db", "server message", "connection=%s text=%s", db->session.app_name, text);
}

/* Connecting: drives PQconnectPoll; DB_EV_NONE while it goes on. */
static enum db_event advance_connect(struct db *db, double now, char *errstr, size_t size) {
        if (now > db->connect_deadline) {
                errstr_set(errstr, size, "connect: no answer within %.0f s", CONNECT_TIMEOUT_S);
                db_async_close(db);
                return DB_EV_DOWN;
        }
        PostgresPollingStatusType st = PQconnectPoll(db->conn);
        if (st == PGRES_POLLING_READING || st == PGRES_POLLING_WRITING) {
                db->connect_polling = st;
                return DB_EV_NONE;
        }
        if (st == PGRES_POLLING_FAILED) {
                errstr_set(errstr, size, "connect: %s", PQerrorMessage(db->conn));
                db_conninfo_scrub(db->url, errstr); /* should libpq ever quote a secret */
                db_async_close(db);
                return DB_EV_DOWN;
        }
        if (PQsetnonblocking(db->conn, 1) != 0) {
                errstr_set(errstr, size, "connect: %s", PQerrorMessage(db->conn));
                db_async_close(db);
                return DB_EV_DOWN;
        }
        PQsetNoticeReceiver(db->conn, on_notice, db);
        if (next_setup(db, errstr, size) != 0) {
                db_async_close(db);
                return DB_EV_DOWN;
        }
        return DB_EV_NONE;
}

/* Reads every result of the query sent last. 1 once it is complete (*out:
 * the first error, else the last result; the caller clears it), 0 while
 * more is owed, -1 when the connection broke. */
static int collect(struct db *db, PGresult **out) {
        if (!PQconsumeInput(db->conn))
                return -1;
        for (PGnotify *n; (n = PQnotifies(db->conn)) != NULL; PQfreemem(n))
                db->notified = 1;
        while (!PQisBusy(db->conn)) {
                PGresult *r = PQgetResult(db->conn);
                if (!r) {
                        *out = db->pending;
                        db->pending = NULL;
                        return 1;
                }
                ExecStatusType st = PQresultStatus(r);
                int failed = st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK;
                int had_error = db->pending && PQresultStatus(db->pending) != PGRES_COMMAND_OK &&
                                PQresultStatus(db->pending) != PGRES_TUPLES_OK;
                if (had_error && !failed) {
                        PQclear(r); /* the first error wins */
                        continue;
                }
                PQclear(db->pending);
                db->pending = r;
        }
        return 0;
}

static struct db_result *result_new(PGresult *r, const char *lost) {
        struct db_result *res = calloc(1, sizeof *res);
        if (!res) {
                PQclear(r);
                return NULL;
        }
        res->r = r;
        ExecStatusType st = r ? PQresultStatus(r) : PGRES_FATAL_ERROR;
        if (r && (st == PGRES_COMMAND_OK || st == PGRES_TUPLES_OK))
                return res;
        const char *state = r ? PQresultErrorField(r, PG_DIAG_SQLSTATE) : NULL;
        snprintf(res->sqlstate, sizeof res->sqlstate, "%s", state ? state : "");
        snprintf(res->error, sizeof res->error, "%s",
                 r && *PQresultErrorMessage(r) ? PQresultErrorMessage(r) : lost);
        res->error[strcspn(res->error, "\n")] = '\0';
        return res;
}

enum db_event db_async_advance(struct db *db, double now, char *errstr, size_t size) {
        PGresult *r = NULL;
        if (db->phase == DB_DOWN || !db->conn)
                return DB_EV_NONE;
        if (db->phase == DB_CONNECTING && db->setup == SETUP_NONE)
                return advance_connect(db, now, errstr, size);
        if (db->phase == DB_CONNECTING && now > db->connect_deadline) {
                errstr_set(errstr, size, "session set-up: no answer within %.0f s",
                           CONNECT_TIMEOUT_S);
                db_async_close(db);
                return DB_EV_DOWN;
        }
        if (db->want_write && flush(db) != 0)
                goto lost;
        if (db->phase == DB_CONNECTING && db->setup == SETUP_STATEMENTS) {
                int got = collect_pipeline(db);
                if (got < 0)
                        goto lost;
                if (got == 0)
                        return DB_EV_NONE;
                if (db->setup_error)
                        errstr_set(errstr, size, "%s", db->setup_why);
                if (db->setup_error || next_setup(db, errstr, size)) {
                        db_async_close(db);
                        return DB_EV_DOWN;
                }
                db->phase = DB_IDLE;
                db->connects++;
                return DB_EV_UP;
        }
        int done = collect(db, &r);
        if (done < 0)
                goto lost;
        if (done == 0) {
                if (PQstatus(db->conn) != CONNECTION_OK)
                        goto lost;
                return DB_EV_NONE;
        }
        if (db->phase == DB_CONNECTING) { /* the timeout's or the session step's answer */
                ExecStatusType st = r ? PQresultStatus(r) : PGRES_FATAL_ERROR;
                int ok = st == PGRES_COMMAND_OK || st == PGRES_TUPLES_OK;
                const char *state = r ? PQresultErrorField(r, PG_DIAG_SQLSTATE) : NULL;
                if (!ok && state && !strcmp(state, "57014") &&
                    db->setup_tries < SETUP_TIMEOUT_TRIES) {
                        PQclear(r);
                        if ((db->setup == SETUP_TIMEOUT ? send_timeout(db, errstr, size)
                                                        : resend_session(db, errstr, size)) == 0)
                                return DB_EV_NONE;
                        db_async_close(db);
                        return DB_EV_DOWN;
                }
                if (!ok && state && !strcmp(state, "55P03"))
                        db->table_locked = 1;
                if (!ok)
                        errstr_set(errstr, size, "session set-up: %s",
                                   r ? PQresultErrorMessage(r) : PQerrorMessage(db->conn));
                if (!ok || (db->setup == SETUP_SESSION && read_session(db, r, errstr, size)) ||
                    next_setup(db, errstr, size)) {
                        PQclear(r);
                        db_async_close(db);
                        return DB_EV_DOWN;
                }
                PQclear(r);
                return DB_EV_NONE;
        }
        /* A statement's answer. The connection may have broken right after
         * it (the server's FATAL comes as the error): the caller sees the
         * result, then DB_DOWN. */
        if (db->running) {
                db->done = result_new(r, "no answer");
                db->running = NULL;
                if (!db->done)
                        goto no_memory;
                db->phase = PQstatus(db->conn) == CONNECTION_OK ? DB_IDLE : DB_DOWN;
                if (db->phase == DB_DOWN)
                        db_async_close(db);
                return DB_EV_RESULT;
        }
        PQclear(r); /* nothing was asked: a NOTIFY or a notice only */
        return DB_EV_NONE;
lost:
        PQclear(r);
        errstr_set(errstr, size, "connection lost: %s", PQerrorMessage(db->conn));
        if (db->running) {
                /* no error from the server: the statement's outcome is unknown */
                db->done = result_new(NULL, "connection lost before the answer");
                db->running = NULL;
                db_async_close(db);
                return db->done ? DB_EV_RESULT : DB_EV_DOWN;
        }
        db_async_close(db);
        return DB_EV_DOWN;
no_memory:
        /* An answer with nowhere to go: the connection is closed, so the
         * caller treats the statement as one a lost connection took. */
        errstr_set(errstr, size, "out of memory for a statement's answer");
        db_async_close(db);
        return DB_EV_DOWN;
}

int db_async_send(struct db *db, int stmt, int nparams, const char *const *params, int binary,
                  double now, char *errstr, size_t errstr_size) {
        if (db->phase != DB_IDLE)
                return errstr_set(errstr, errstr_size, "not ready for a statement");
        const struct db_sql *s = &db->session.sql[stmt];
        /* A connection the server said it is closing is not used: the
         * statement is then known not to have run. */
        if (db->closing || !PQconsumeInput(db->conn) || PQstatus(db->conn) != CONNECTION_OK) {
                errstr_set(errstr, errstr_size, "%s: not sent: %s", s->name,
                           db->closing ? "the server is closing the connection"
                                       : PQerrorMessage(db->conn));
                db_async_close(db);
                return -1;
        }
        if (!PQsendQueryPrepared(db->conn, s->name, nparams, params, NULL, NULL, binary ? 1 : 0) ||
            flush(db) != 0) {
                errstr_set(errstr, errstr_size, "%s: %s", s->name, PQerrorMessage(db->conn));
                db_async_close(db);
                return -1;
        }
        db_result_free(db->done); /* a result nobody took */
        db->done = NULL;
        db->phase = DB_BUSY;
        db->running = s->name;
        db->running_since = now;
        return 0;
}

const char *db_async_running(const struct db *db, double *since) {
        if (since)
                *since = db->running_since;
        return db->phase == DB_BUSY ? db->running : NULL;
}

struct db_result *db_async_result(struct db *db) {
        struct db_result *r = db->done;
        db->done = NULL;
        return r;
}

int db_async_notified(struct db *db) {
        int n = db->notified;
        db->notified = 0;
        return n;
}

int db_async_table_missing(const struct db *db) {
        return db->table_missing;
}

int db_async_too_old(const struct db *db) {
        return db->too_old;
}

int db_async_table_locked(const struct db *db) {
        return db->table_locked;
}

/* ---- results ---- */

int db_result_ok(const struct db_result *r) {
        if (!r->r)
                return 0;
        ExecStatusType st = PQresultStatus(r->r);
        return st == PGRES_COMMAND_OK || st == PGRES_TUPLES_OK;
}

const char *db_result_sqlstate(const struct db_result *r) {
        return r->sqlstate;
}

const char *db_result_error(const struct db_result *r) {
        return r->error;
}

int db_result_rows(const struct db_result *r) {
        return r->r ? PQntuples(r->r) : 0;
}

int db_result_cols(const struct db_result *r) {
        return r->r ? PQnfields(r->r) : 0;
}

const char *db_result_value(const struct db_result *r, int row, int col) {
        return PQgetvalue(r->r, row, col);
}

int db_result_length(const struct db_result *r, int row, int col) {
        return PQgetlength(r->r, row, col);
}

int db_result_isnull(const struct db_result *r, int row, int col) {
        return PQgetisnull(r->r, row, col);
}

long long db_result_changed(const struct db_result *r) {
        return r->r ? strtoll(PQcmdTuples(r->r), NULL, 10) : 0;
}

void db_result_free(struct db_result *r) {
        if (!r)
                return;
        PQclear(r->r);
        free(r);
}

enum db_fault db_fault_of(const char *s) {
        static const char *const session[] = {
                "0A000", /* cached plan must not change result type (ALTER TABLE) */
                "26000", /* prepared statement does not exist */
                "42P01", /* undefined table */
                "3F000", /* undefined schema */
                "42703", /* undefined column */
                "42883", /* undefined function */
                "42804", /* datatype mismatch (a column's type changed) */
                "57P01", "57P02", "57P03", /* the server shuts down or restarts */
        };
        static const char *const wait[] = {
                "55P03", /* lock_not_available: lock_timeout */
                "57014", /* query_canceled: statement_timeout */
                "40001", /* serialization_failure */
                "40P01", /* deadlock_detected */
                "53300", /* too_many_connections */
        };
        if (!s || !*s)
                return DB_FAULT_NONE;
        for (size_t i = 0; i < sizeof session / sizeof session[0]; i++)
                if (!strcmp(s, session[i]))
                        return DB_FAULT_SESSION;
        if (!strncmp(s, "08", 2)) /* connection exception */
                return DB_FAULT_SESSION;
        for (size_t i = 0; i < sizeof wait / sizeof wait[0]; i++)
                if (!strcmp(s, wait[i]))
                        return DB_FAULT_WAIT;
        return DB_FAULT_STATEMENT;
}

/* ---- binary values ---- */

long long db_int(const char *bin, int len) {
        uint64_t v = 0;
        for (int i = 0; i < len && i < 8; i++)
                v = v << 8 | (unsigned char)bin[i];
        if (len == 2)
                return (int16_t)v;
        if (len == 4)
                return (int32_t)v;
        return (long long)(int64_t)v;
}

void db_tid_text(const char *bin, int len, char *out) {
        if (len != 6) {
                snprintf(out, DB_TID_TEXT, "(0,0)");
                return;
        }
        unsigned long block = (unsigned long)(uint32_t)db_int(bin, 4);
        unsigned off = (unsigned)(uint16_t)db_int(bin + 4, 2);
        snprintf(out, DB_TID_TEXT, "(%lu,%u)", block, off);
}

void db_uuid_text(const char *bin, int len, char *out) {
        static const char hex[] = "0123456789abcdef";
        size_t o = 0;
        for (int i = 0; i < 16; i++) {
                unsigned char b = i < len ? (unsigned char)bin[i] : 0;
                if (i == 4 || i == 6 || i == 8 || i == 10)
                        out[o++] = '-';
                out[o++] = hex[b >> 4];
                out[o++] = hex[b & 15];
        }
        out[o] = '\0';
}

long long db_timestamptz(const char *bin, int len) {
        return len == 8 ? db_int(bin, 8) : 0;
}
