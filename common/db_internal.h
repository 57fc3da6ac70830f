/* db_internal.h - what the db files share: the handle and the statement
 * table. Include it only from common/db*.c; everyone else uses db.h. */
#ifndef OUTBOX_DB_INTERNAL_H
#define OUTBOX_DB_INTERNAL_H

#include <libpq-fe.h>
#include <stddef.h>

#include "db.h"
#include "encode.h"

struct db {
        char *url, *table, *relay_id;
        PGconn *conn;
        char *qtable;  /* "schema"."table", resolved at connect */
        char *channel; /* schema.table */
        long connects; /* successful db_connect() calls */
        /* db_lock_send() sent this lock statement; db_lock_receive() owes its
         * result before the connection takes anything else */
        const struct db_stmt *lock_sent;
        int closing; /* the server said it is closing this connection (FATAL) */
        enum db_order order;
        int test_lock_delay_ms, test_sample_delay_ms;
        /* outboxctl's connection (db_set_admin): the operator statements
         * only, no LISTEN */
        int admin;
        char *topic_template;
        char *topic_expr; /* SQL text of row o's topic, built at connect */
        int admin_temp;   /* bit mask of the temp tables made on this connection */
        struct buf copy;  /* COPY data not yet sent (db_reconcile_put()) */
};

/* One SQL statement, prepared on every connect under `name`. `sql` names the
 * table as %1$s (as often as it needs); the lock statements also hold %2$s,
 * where the lock test hook's pause goes (nothing in other builds), and the
 * operator statements use %2$s for the topic of row `o` (topic_name, else
 * OUTBOX_TOPIC_TEMPLATE filled in). Errors start with `what`. */
struct db_stmt {
        const char *name;
        const char *what;
        int nparams;
        const char *sql;
};

/* The statement tables of db_claim.c and db_table.c. */
extern const struct db_stmt db_claim_stmts[];
extern const size_t db_claim_stmt_count;
extern const struct db_stmt db_table_stmts[];
extern const size_t db_table_stmt_count;

/* The operator statements of db_admin.c that need no temp table: prepared
 * at connect on an admin connection (db_admin_prepare()), never by the
 * daemons. */
extern const struct db_stmt db_admin_stmts[];
extern const size_t db_admin_stmt_count;

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
 * connection too when the table or a column it names is gone. */
void db_check_result(struct db *db, const PGresult *r);

/* Runs a statement without parameters that is not in a table (transaction
 * control); -1 (errstr set) unless it succeeded. */
int db_exec_simple(struct db *db, const char *sql, char *errstr, size_t size);

/* Runs prepared statement `s` with its text parameters. The result when its
 * status is `want` (PQclear() it), else NULL with errstr "<what>: <why>" and
 * the connection dropped if it was lost. */
PGresult *db_run(struct db *db, const struct db_stmt *s, const char *const *params,
                 ExecStatusType want, char *errstr, size_t size);

/* db_run() for a statement that changes rows: *n gets how many. */
int db_run_count(struct db *db, const struct db_stmt *s, const char *const *params, long long *n,
                 char *errstr, size_t size);

#endif
