/* db.c - the database handle, and its blocking use (the sweeper,
 * outboxctl): connect, prepare the statement tables, run statements. The
 * relay drives the same handle without blocking (db_async.c). */
#include "db.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "db_internal.h"
#include "encode.h"
#include "errstr.h"
#include "metrics.h"

struct db *db_new(const char *url, const char *table, const char *relay_id) {
        struct db *db = calloc(1, sizeof *db);
        if (!db)
                return NULL;
        db->url = strdup(url);
        db->table = strdup(table);
        db->relay_id = strdup(relay_id);
        struct db_session plain = {.app_name = "outbox-relay"};
        if (!db->url || !db->table || !db->relay_id || db_async_configure(db, &plain) != 0) {
                db_destroy(db);
                return NULL;
        }
        return db;
}

int db_connected(const struct db *db) {
        return db->conn && PQstatus(db->conn) == CONNECTION_OK &&
               (db->phase == DB_IDLE || db->phase == DB_BUSY);
}

void db_check_conn(struct db *db) {
        if (db->conn && PQstatus(db->conn) != CONNECTION_OK)
                db_disconnect(db);
}

void db_check_result(struct db *db, const PGresult *r) {
        /* the table or a column went away or changed under the prepared
         * statements: a reconnect resolves it again (and reports it missing,
         * with backoff and not-ready, until it is back) */
        if (db_fault_of(r ? PQresultErrorField(r, PG_DIAG_SQLSTATE) : NULL) == DB_FAULT_SESSION) {
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
        const char *state = r ? PQresultErrorField(r, PG_DIAG_SQLSTATE) : NULL;
        metrics_add2(M_STATEMENT_ERRORS, s->name, state ? state : "", 1);
        db_check_result(db, r);
        PQclear(r);
        return NULL;
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

const char *db_table_name(const struct db *db) {
        return db->qtable;
}

/* Waits (poll) until the connection has something for db_async_advance():
 * its socket is ready, or its deadline passed. */
static void wait_ready(struct db *db, double until) {
        short events = 0;
        int fd = db_async_fd(db, &events);
        double left = until - clock_mono_s();
        if (fd < 0 || left <= 0)
                return;
        struct pollfd pfd = {.fd = fd, .events = events};
        int ms = (int)(left * 1000) + 1;
        while (poll(&pfd, 1, ms) < 0 && errno == EINTR)
                ;
}

int db_connect(struct db *db, char *errstr, size_t errstr_size) {
        double now = clock_mono_s();
        if (db_async_start(db, now, errstr, errstr_size) != 0)
                return -1;
        for (;;) {
                enum db_event ev = db_async_advance(db, clock_mono_s(), errstr, errstr_size);
                if (ev == DB_EV_DOWN)
                        return db_async_too_old(db) ? DB_ERR_SERVER_VERSION : -1;
                if (ev == DB_EV_UP)
                        break;
                double deadline = db_async_deadline(db);
                wait_ready(db, deadline > 0 ? deadline : clock_mono_s() + 1);
        }
        /* The blocking calls below use libpq's blocking mode. */
        if (PQsetnonblocking(db->conn, 0) != 0) {
                errstr_set(errstr, errstr_size, "connect: %s", PQerrorMessage(db->conn));
                goto fail;
        }
        if (db->after_connect && db->after_connect(db, errstr, errstr_size))
                goto fail;
        return 0;
fail:
        db_disconnect(db);
        return -1;
}

struct db_result *db_exec(struct db *db, int stmt, int nparams, const char *const *params,
                          int binary, char *errstr, size_t errstr_size) {
        if (db_async_send(db, stmt, nparams, params, binary, clock_mono_s(), errstr, errstr_size) !=
            0)
                return NULL;
        for (;;) {
                enum db_event ev = db_async_advance(db, clock_mono_s(), errstr, errstr_size);
                if (ev == DB_EV_RESULT)
                        return db_async_result(db);
                if (ev == DB_EV_DOWN)
                        return NULL;
                wait_ready(db, clock_mono_s() + 1);
        }
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
        db_result_free(db->done);
        free(db->url);
        free(db->table);
        free(db->relay_id);
        free(db->topic_template);
        free(db->session_app);
        free(db);
}
