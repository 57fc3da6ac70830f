/* db_async.h - a database connection driven by the caller's poll() loop:
 * connecting, the session's set-up, one statement at a time, NOTIFY, all
 * without blocking. The relay runs each of its connections this way; the
 * sweeper and outboxctl use the blocking calls of db.h on the same kind of
 * handle. Part of the db module (the only one that includes libpq); this
 * header does not include it. */
#ifndef OUTBOX_DB_ASYNC_H
#define OUTBOX_DB_ASYNC_H

#include <stddef.h>

#include "db.h"

/* What a connection's session sets, whatever the database's and the role's
 * defaults (docs/DESIGN.md, "Sessions"). */
struct db_session {
        const char *app_name;     /* application_name */
        int statement_timeout_ms; /* statement_timeout */
        int lock_timeout_ms;      /* lock_timeout */
        /* The plan types the daemons' statements never want (sequential and
         * bitmap scans, sorts an index can replace, hash and merge joins)
         * are turned off, so no statistics can change a statement's shape. */
        int fixed_plans;
        int listen;               /* LISTEN on the table's NOTIFY channel */
        const struct db_sql *sql; /* the statements (borrowed), indexed by the caller */
        size_t nsql;
        unsigned long long prepare;   /* bit i: statement i is prepared at connect (0: all) */
        int test_lock_delay_ms;       /* test builds: a pause in lock statements */
        int test_mark_delay_ms;       /* test builds: a pause in mark statements */
        int test_sample_delay_ms;     /* test builds: a pause in the table sample */
        int test_fetch_fault_version; /* test builds: fetches fail on rows of this version */
        int test_fetch_kill_version;  /* test builds: fetches of this version end the session */
};

/* Copies the session's settings into db (the statements are borrowed and
 * must outlive it), before the first db_async_start(). 0, or -1 out of
 * memory. */
int db_async_configure(struct db *db, const struct db_session *s)
        __attribute__((warn_unused_result));

/* The phases of a connection. */
enum db_phase {
        DB_DOWN = 0,   /* not connected: db_async_start() begins */
        DB_CONNECTING, /* connecting, then setting the session up */
        DB_IDLE,       /* ready for a statement */
        DB_BUSY        /* a statement is running */
};
enum db_phase db_async_phase(const struct db *db);

/* Begins to connect (never blocks). 0, or -1 with errstr (the connection
 * string cannot be used, out of memory). */
int db_async_start(struct db *db, double now, char *errstr, size_t errstr_size)
        __attribute__((warn_unused_result));

/* The socket to poll and the events it waits for (POLLIN, POLLOUT); -1 when
 * there is none (DB_DOWN). */
int db_async_fd(const struct db *db, short *events);

/* What db_async_advance() saw happen. */
enum db_event {
        DB_EV_NONE = 0,
        DB_EV_UP,     /* connected and set up: DB_IDLE */
        DB_EV_RESULT, /* the statement finished: db_async_result() has it */
        DB_EV_DOWN    /* the connection failed or was lost: DB_DOWN, errstr says why */
};

/* Moves the connection on: reads what the server sent, sends what waits,
 * goes on with connecting or set-up, and gives up on a connect that took
 * longer than its deadline. Call it when the socket is ready, and at
 * `now` >= db_async_deadline(). Never blocks. */
enum db_event db_async_advance(struct db *db, double now, char *errstr, size_t errstr_size);

/* When db_async_advance() must run even without I/O (the connect
 * deadline); 0 when nothing is timed. */
double db_async_deadline(const struct db *db);

/* Sends prepared statement `stmt` (index into the session's statements)
 * with its parameters as text (NULL for SQL NULL). The result comes as
 * binary when `binary` (libpq's binary format for every column), else as
 * text. Only in DB_IDLE. 0, or -1 with errstr (the connection is then down:
 * the statement did not run). */
int db_async_send(struct db *db, int stmt, int nparams, const char *const *params, int binary,
                  double now, char *errstr, size_t errstr_size) __attribute__((warn_unused_result));

/* db_async_send(), then waits (blocking) for its result: for programs
 * without a loop of their own (the sweeper, benches). NULL with errstr when
 * the connection failed before an answer. */
struct db_result *db_exec(struct db *db, int stmt, int nparams, const char *const *params,
                          int binary, char *errstr, size_t errstr_size);

/* The statement running now (its name), and since when; NULL when idle. */
const char *db_async_running(const struct db *db, double *since);

/* A finished statement's result: rows, or an error with its SQLSTATE. */
struct db_result;

/* Takes the result db_async_advance() announced with DB_EV_RESULT (the
 * caller frees it with db_result_free()); NULL when there is none. */
struct db_result *db_async_result(struct db *db);

/* Nonzero once since the last call if a NOTIFY arrived on the channel. */
int db_async_notified(struct db *db);

/* The server's clock when the session was set up (timestamptz text). */
const char *db_async_connected_at(const struct db *db);

/* Why the last connect failed, when it was not the connection itself: the
 * table OUTBOX_TABLE names does not exist, the server is older than the
 * oldest supported (14), or a set-up statement waited for a lock longer than
 * the lock timeout (another session holds the table: an ALTER TABLE, a
 * VACUUM FULL, a LOCK TABLE left open). */
int db_async_table_missing(const struct db *db);
int db_async_too_old(const struct db *db);
int db_async_table_locked(const struct db *db);

/* Drops the connection (DB_DOWN). */
void db_async_close(struct db *db);

/* ---- results ---- */

/* Nonzero for a result with rows or a command tag, 0 for an error. */
int db_result_ok(const struct db_result *r);
/* The error's SQLSTATE ("" when none: the connection broke) and text (one
 * line, no password). */
const char *db_result_sqlstate(const struct db_result *r);
const char *db_result_error(const struct db_result *r);
/* Rows and columns; a cell's bytes (NUL-terminated by libpq; binary cells
 * are raw), their length, and whether it is NULL. */
int db_result_rows(const struct db_result *r);
int db_result_cols(const struct db_result *r);
const char *db_result_value(const struct db_result *r, int row, int col);
int db_result_length(const struct db_result *r, int row, int col);
int db_result_isnull(const struct db_result *r, int row, int col);
/* Rows a command changed (its tag), 0 when it says none. */
long long db_result_changed(const struct db_result *r);
void db_result_free(struct db_result *r);

/* What an error says about what to do next. */
enum db_fault {
        DB_FAULT_NONE = 0,
        /* a fresh session cures it: a cached plan whose result type changed
         * (ALTER TABLE), a prepared statement gone, the table or a column
         * renamed or dropped, the server closing the session */
        DB_FAULT_SESSION,
        /* it waited too long: lock_timeout, statement_timeout, a
         * serialization failure, a deadlock; trying again later may pass */
        DB_FAULT_WAIT,
        /* anything else: the same statement is likely to fail again */
        DB_FAULT_STATEMENT
};
enum db_fault db_fault_of(const char *sqlstate);

/* ---- binary values (results asked for with `binary`) ---- */

/* A tid (6 bytes: block, offset) as PostgreSQL's text form "(block,offset)"
 * into out (at least DB_TID_TEXT bytes). */
#define DB_TID_TEXT 24
void db_tid_text(const char *bin, int len, char *out);
/* A uuid (16 bytes) as its 36-character text into out (at least 37 bytes). */
void db_uuid_text(const char *bin, int len, char *out);
/* Big-endian integers of 2, 4 or 8 bytes. */
long long db_int(const char *bin, int len);
/* A timestamptz: microseconds since 2000-01-01 UTC; INT64_MAX and
 * INT64_MIN are 'infinity' and '-infinity'. */
long long db_timestamptz(const char *bin, int len);

#endif
