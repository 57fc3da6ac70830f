/* db_internal.h - what the db files share: the handle and the statement
 * table. Include it only from common/db*.c; everyone else uses db.h and
 * db_async.h. */
#ifndef OUTBOX_DB_INTERNAL_H
#define OUTBOX_DB_INTERNAL_H

#include <libpq-fe.h>
#include <stddef.h>

#include "db.h"
#include "db_async.h"
#include "encode.h"

struct db {
        char *url, *table, *relay_id;
        PGconn *conn;
        char *qtable;  /* "schema"."table", resolved at connect */
        char *channel; /* schema.table, cut to 63 bytes as the NOTIFY trigger cuts it */
        long connects; /* successful connects */
        int closing;   /* the server said it is closing this connection (FATAL) */
        /* A hook run after every connect once the table is resolved
         * (outboxctl's connection prepares its statements there). */
        int (*after_connect)(struct db *db, char *errstr, size_t size);
        /* outboxctl's connection (db_set_admin): the operator statements
         * only, no LISTEN */
        int admin;
        char *topic_template;
        char *topic_expr; /* SQL text of row o's topic, built at connect */
        int admin_temp;   /* bit mask of the temp tables made on this connection */
        struct buf copy;  /* COPY data not yet sent (db_reconcile_put()) */

        /* the session (db_async.c) */
        struct db_session session;
        char *session_app;
        enum db_phase phase;
        int setup;           /* enum setup of db_async.c */
        size_t setup_next;   /* set-up commands answered */
        int setup_error;     /* one of them failed (the first one's error is kept) */
        char setup_why[512]; /* that error, until the set-up's end reports it */
        int setup_tries;     /* the statement timeout's SET, sent this many times */
        PostgresPollingStatusType connect_polling;
        double connect_deadline;
        int want_write;      /* libpq holds data back: wait for POLLOUT */
        const char *running; /* name of the statement running */
        double running_since;
        PGresult *pending;      /* the answer being collected */
        struct db_result *done; /* the finished statement's, for db_async_result() */
        int notified;
        char connected_at[48];
        int table_missing, too_old;
        int table_locked; /* a set-up statement gave up on a lock (55P03) */
};

/* One SQL statement of the legacy tables, prepared on every connect under
 * `name`. `sql` names the table as %1$s (as often as it needs); the operator
 * statements use %2$s for the topic of row `o` (topic_name, else
 * OUTBOX_TOPIC_TEMPLATE filled in). Errors start with `what`. */
struct db_stmt {
        const char *name;
        const char *what;
        int nparams;
        const char *sql;
};

/* The operator statements of db_admin.c that need no temp table: prepared
 * at connect on an admin connection (db_admin_prepare()), never by the
 * daemons. */
extern const struct db_stmt db_admin_stmts[];
extern const size_t db_admin_stmt_count;

/* Sets the resolved table: its quoted name and its NOTIFY channel. 0, or -1
 * with errstr set. */
int db_set_table(struct db *db, const char *schema, const char *name, char *errstr, size_t size);

/* The channel the NOTIFY trigger sends on for table schema.name: the two
 * joined by a dot, cut to 63 bytes (PostgreSQL's longest identifier) at a
 * UTF-8 character boundary. out holds at least 64 bytes. */
void db_channel_name(const char *schema, const char *name, char *out);

/* Prepares `n` statements, the table name as %1$s and arg2 as %2$s in their
 * text. 0, or -1 with errstr set. */
int db_prepare(struct db *db, const struct db_stmt *stmts, size_t n, const char *arg2, char *errstr,
               size_t size);

/* An admin connection's set-up after the table is resolved: builds the topic
 * expression and prepares db_admin_stmts. 0 or -1 (errstr set). */
int db_admin_prepare(struct db *db, char *errstr, size_t size);

/* A statement failed: drops the connection if it is gone, so the caller
 * reconnects. */
void db_check_conn(struct db *db);

/* A statement failed with result r: db_check_conn(), and drops the
 * connection too when a fresh session would cure it (DB_FAULT_SESSION). */
void db_check_result(struct db *db, const PGresult *r);

/* Runs a statement without parameters that is not in a table (transaction
 * control); -1 (errstr set) unless it succeeded. */
int db_exec_simple(struct db *db, const char *sql, char *errstr, size_t size);

/* Runs prepared statement `s` with its text parameters. The result when its
 * status is `want` (PQclear() it), else NULL with errstr "<what>: <why>" and
 * the connection dropped if it was lost. */
PGresult *db_run(struct db *db, const struct db_stmt *s, const char *const *params,
                 ExecStatusType want, char *errstr, size_t size);

#endif
