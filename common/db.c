/* db.c - the database connection: connect, prepare the statement tables,
 * run statements, wait for NOTIFY. */
#include "db.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "db_conninfo.h"
#include "db_internal.h"
#include "encode.h"
#include "errstr.h"
#include "log.h"

/* A half-dead connection must fail within about a minute, not the kernel's
 * default quarter of an hour: keepalives and a TCP user timeout. */
static const char *const conn_keys[] = {"application_name", "connect_timeout",
                                        "keepalives_idle",  "keepalives_interval",
                                        "keepalives_count", "tcp_user_timeout"};
static const char *const conn_vals[] = {"outbox-relay", "10", "30", "10", "3", "60000"};
/* application_name of an operator's connection */
#define ADMIN_APP_NAME "outboxctl"
#define CONN_PARAMS    (sizeof conn_keys / sizeof conn_keys[0])

/* PostgreSQL's longest identifier, and so NOTIFY channel name. */
#define CHANNEL_MAX 63

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

void db_set_order(struct db *db, enum db_order order) {
        db->order = order;
}

int db_set_admin(struct db *db, const char *topic_template) {
        char *t = strdup(topic_template);
        if (!t)
                return -1;
        free(db->topic_template);
        db->topic_template = t;
        db->admin = 1;
        return 0;
}

void db_set_test_hooks(struct db *db, int lock_delay_ms, int sample_delay_ms) {
        db->test_lock_delay_ms = lock_delay_ms > 0 ? lock_delay_ms : 0;
        db->test_sample_delay_ms = sample_delay_ms > 0 ? sample_delay_ms : 0;
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
        free(db->topic_expr);
        db->qtable = db->channel = db->topic_expr = NULL;
        db->admin_temp = 0; /* temp tables go with the session */
        buf_free(&db->copy);
}

void db_check_conn(struct db *db) {
        if (db->conn && PQstatus(db->conn) != CONNECTION_OK)
                db_disconnect(db);
}

void db_check_result(struct db *db, const PGresult *r) {
        const char *state = r ? PQresultErrorField(r, PG_DIAG_SQLSTATE) : NULL;
        /* undefined table, schema or column: the table went away or changed
         * under the prepared statements; a reconnect resolves it again (and
         * reports it missing, with backoff and not-ready, until it is back) */
        if (state &&
            (!strcmp(state, "42P01") || !strcmp(state, "3F000") || !strcmp(state, "42703"))) {
                db_disconnect(db);
                return;
        }
        db_check_conn(db);
}

int db_exec_simple(struct db *db, const char *sql, char *errstr, size_t size) {
        PGresult *r = PQexec(db->conn, sql);
        ExecStatusType st = PQresultStatus(r);
        int rc = 0;
        if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK)
                rc = errstr_set(errstr, size, "%s", PQerrorMessage(db->conn));
        PQclear(r);
        return rc;
}

PGresult *db_run(struct db *db, const struct db_stmt *s, const char *const *params,
                 ExecStatusType want, char *errstr, size_t size) {
        PGresult *r = PQexecPrepared(db->conn, s->name, s->nparams, params, NULL, NULL, 0);
        if (PQresultStatus(r) == want)
                return r;
        errstr_set(errstr, size, "%s: %s", s->what, PQerrorMessage(db->conn));
        db_check_result(db, r);
        PQclear(r);
        return NULL;
}

int db_run_count(struct db *db, const struct db_stmt *s, const char *const *params, long long *n,
                 char *errstr, size_t size) {
        PGresult *r = db_run(db, s, params, PGRES_COMMAND_OK, errstr, size);
        *n = 0;
        if (!r)
                return -1;
        *n = strtoll(PQcmdTuples(r), NULL, 10);
        PQclear(r);
        return 0;
}

int db_prepare(struct db *db, const struct db_stmt *stmts, size_t n, const char *arg2, char *errstr,
               size_t size) {
        struct buf sql = {0};
        int rc = 0;
        for (size_t i = 0; i < n && rc == 0; i++) {
                buf_reset(&sql);
                /* the formats are the statement tables' literals (%1$s, %2$s) */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wformat-nonliteral"
                int built = buf_appendf(&sql, stmts[i].sql, db->qtable, arg2);
#pragma GCC diagnostic pop
                if (built != 0) {
                        rc = errstr_set(errstr, size, "out of memory");
                        break;
                }
                PGresult *r = PQprepare(db->conn, stmts[i].name, sql.data, stmts[i].nparams, NULL);
                if (PQresultStatus(r) != PGRES_COMMAND_OK)
                        rc = errstr_set(errstr, size, "prepare %s: %s", stmts[i].name,
                                        PQerrorMessage(db->conn));
                PQclear(r);
        }
        buf_free(&sql);
        return rc;
}

static int prepare_all(struct db *db, char *errstr, size_t size) {
        char pause[64] = "";
#ifdef OUTBOX_TEST_HOOKS
        /* Every lock statement pauses between its start and its row locks, so
         * a fault test can change a row in between. */
        if (db->test_lock_delay_ms) {
                snprintf(pause, sizeof pause, " AND (SELECT true FROM pg_sleep(%d / 1000.0))",
                         db->test_lock_delay_ms);
                log_warn("db", "test hook: every lock statement pauses", "ms=%d",
                         db->test_lock_delay_ms);
        }
#endif
        if (db_prepare(db, db_claim_stmts, db_claim_stmt_count, pause, errstr, size) != 0)
                return -1;
        return db_prepare(db, db_table_stmts, db_table_stmt_count, pause, errstr, size);
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

/* Resolves OUTBOX_TABLE to its quoted name and NOTIFY channel, as the trigger
 * names it (schema.table, cut to CHANNEL_MAX bytes on a character boundary).
 * Runs before the statement tables are prepared, which need the name. */
static int resolve_table(struct db *db, char *errstr, size_t size) {
        const char *param[1] = {db->table};
        char *nsp = NULL, *rel = NULL;
        int rc = -1;
        PGresult *r = PQexecParams(db->conn,
                                   "SELECT n.nspname, c.relname FROM pg_class c"
                                   " JOIN pg_namespace n ON n.oid = c.relnamespace"
                                   " WHERE c.oid = to_regclass($1)",
                                   1, NULL, param, NULL, NULL, 0);
        if (PQresultStatus(r) != PGRES_TUPLES_OK) {
                errstr_set(errstr, size, "resolve table: %s", PQerrorMessage(db->conn));
                goto out;
        }
        if (PQntuples(r) != 1) {
                errstr_set(errstr, size,
                           "table %s does not exist (apply schemas/postgres/*.sql first)",
                           db->table);
                goto out;
        }
        const char *schema = PQgetvalue(r, 0, 0), *name = PQgetvalue(r, 0, 1);
        nsp = PQescapeIdentifier(db->conn, schema, strlen(schema));
        rel = PQescapeIdentifier(db->conn, name, strlen(name));
        size_t qlen = (nsp ? strlen(nsp) : 0) + (rel ? strlen(rel) : 0) + 2;
        size_t clen = strlen(schema) + strlen(name) + 2;
        db->qtable = malloc(qlen);
        db->channel = malloc(clen);
        if (!nsp || !rel || !db->qtable || !db->channel) {
                errstr_set(errstr, size, "out of memory");
                goto out;
        }
        snprintf(db->qtable, qlen, "%s.%s", nsp, rel);
        snprintf(db->channel, clen, "%s.%s", schema, name);
        db->channel[encode_utf8_prefix(db->channel, CHANNEL_MAX)] = '\0';
        rc = 0;
out:
        PQclear(r);
        if (nsp)
                PQfreemem(nsp);
        if (rel)
                PQfreemem(rel);
        return rc;
}

static int listen_channel(struct db *db, char *errstr, size_t size) {
        char *qchan = PQescapeIdentifier(db->conn, db->channel, strlen(db->channel));
        char listen[300];
        if (!qchan)
                return errstr_set(errstr, size, "out of memory");
        snprintf(listen, sizeof listen, "LISTEN %s", qchan);
        PQfreemem(qchan);
        return db_exec_simple(db, listen, errstr, size);
}

int db_connect(struct db *db, char *errstr, size_t errstr_size) {
        /* The URL comes last, so its own settings win. */
        const char *keys[CONN_PARAMS + 2], *vals[CONN_PARAMS + 2];
        for (size_t i = 0; i < CONN_PARAMS; i++) {
                keys[i] = conn_keys[i];
                vals[i] = conn_vals[i];
        }
        if (db->admin)
                vals[0] = ADMIN_APP_NAME;
        keys[CONN_PARAMS] = "dbname";
        vals[CONN_PARAMS] = db->url;
        keys[CONN_PARAMS + 1] = vals[CONN_PARAMS + 1] = NULL;
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
        if (resolve_table(db, errstr, errstr_size))
                goto out;
        if (db->admin) {
                if (db_admin_prepare(db, errstr, errstr_size))
                        goto out;
        } else {
                if (listen_channel(db, errstr, errstr_size))
                        goto out;
                /* JIT compiling the lock statements costs more than running
                 * them (hundreds of ms on a hot aggregate's backlog). */
                if (db_exec_simple(db, "SET jit = off", errstr, errstr_size))
                        goto out;
                if (prepare_all(db, errstr, errstr_size))
                        goto out;
        }
        db->connects++;
        rc = 0;
out:
        if (rc)
                db_disconnect(db);
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

long db_connects(const struct db *db) {
        return db->connects;
}

int db_backend_pid(const struct db *db) {
        return db->conn ? PQbackendPID(db->conn) : 0;
}

void db_destroy(struct db *db) {
        if (!db)
                return;
        db_disconnect(db);
        free(db->url);
        free(db->table);
        free(db->relay_id);
        free(db->topic_template);
        free(db);
}
