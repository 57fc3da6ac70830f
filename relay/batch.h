/* batch.h - the rows one lock statement took, from the lock to the marks:
 * each row is its event and its outcome together (docs/DESIGN.md,
 * "Status machine"). A batch keeps the results its rows' strings live in:
 * the lock's answer (identity) and the fetches' (content), each freed once
 * no row needs it. */
#ifndef OUTBOX_BATCH_H
#define OUTBOX_BATCH_H

#include <stddef.h>

#include "config.h"
#include "db_async.h"
#include "decide.h"
#include "encode.h"
#include "event.h"

/* Where a row is. */
enum row_stage {
        ROW_LOCKED = 0, /* locked, content not fetched yet */
        ROW_READY,      /* fetched: may be produced once its predecessor is acknowledged */
        ROW_PRODUCED,   /* with the producer: its delivery report is owed */
        ROW_SETTLED,    /* its outcome is known: a mark is owed */
        ROW_MARKING,    /* a mark statement with it is running */
        ROW_MARKED      /* done */
};

struct fetch_part;
struct tid_index;

struct row {
        struct outbox_event ev; /* strings borrow from the batch's results */
        char id[37];            /* outbox_id */
        unsigned char id_bin[16];
        char tid[DB_TID_TEXT]; /* ctid after the lock */
        unsigned char tid_bin[6];
        char occurred[40];   /* occurred_at as RFC 3339 */
        long long size;      /* bytes: the lock's estimate, the fetch's measure once fetched */
        long long key;       /* the aggregate's key (lock_*.sql; 0 under OUTBOX_ORDERING=none) */
        struct batch *batch; /* the batch it is in */
        enum row_stage stage;
        /* the outcome (ROW_SETTLED on) */
        enum decide_mark mark;
        int permanent, uncounted;
        const char *code; /* static: rd_kafka_err2name() or the relay's own codes */
        char message[160];
        long long delay_ms; /* FAILED: the backoff */
        double settled_at;  /* monotonic, when its outcome became known */
        int mark_uncertain; /* a mark of it was lost with its connection */
        int held_by_other;  /* a mark including it gave up on a lock: left out of marks */
        double probe_at;    /* monotonic: when mark_probe asks about it again (held_by_other) */
        int behind_held;    /* an earlier version in its run is held: left out of marks */
        int row_locked;     /* the last mark_probe found another transaction's lock on it */
        int asked;          /* in the list of the batch's latest fetch */
        int suspect;        /* asked by a fetch that failed: read alone until read or settled */
        char *topic;        /* the message's topic (for metrics and logs), owned */
        double produced_at; /* monotonic */
        /* its run: the version it waits for and the one that waits for it */
        int prev, next;
        struct fetch_part *part; /* the fetch its content lives in */
};

struct batch {
        struct batch *next;
        struct row *rows; /* by aggregate, then version */
        size_t n;
        size_t parked;            /* rows the lock parked behind a DEAD version (not held) */
        struct tid_index *by_tid; /* the rows in ctid order (to match fetched rows) */
        struct db_result *lock;
        struct fetch_part *parts;
        size_t unfetched; /* rows still to fetch */
        size_t open;      /* rows not yet marked */
        long lock_gen;    /* the lock connection it was locked on (db_connects) */
        double locked_at; /* monotonic: when its lock statement was sent (see batch_new) */
        int dirty;        /* something changed that may let a row be produced */
};

/* Builds a batch from a lock statement's answer (binary format; see
 * relay/sql/lock.sql, lock_none.sql), which it takes; NULL out of memory (the answer is
 * then freed, and the caller must treat its rows as of unknown fate). The
 * rows it deferred are left out (they are not locked); the others come
 * ordered by aggregate and version, their runs decided: late rows are
 * settled DEAD (LATE_VERSION), rows after a hole RELEASED. The batch may be
 * empty. locked_at is when the lock statement was sent: the rows' locked_at,
 * the statement's now() on the server, is no earlier, so the lock's age the
 * relay counts (its produce deadline) is never less than the age by which the
 * sweeper takes the lock back, however long the statement ran. */
struct batch *batch_new(struct db_result *lock, enum config_ordering ordering, long lock_gen,
                        double locked_at);

/* Frees the batch and every result it keeps. NULL is a no-op. */
void batch_free(struct batch *b);

/* Which of a batch's rows still to fetch a fetch asks for. */
enum fetch_ask {
        ASK_ALL,   /* every one */
        ASK_HEADS, /* the first of each run (each can go once read, whatever
                    * part of them a fetch's byte limit lets come) */
        ASK_ONE,   /* the first suspect of the first run with one, alone: a
                    * fetch computes the text of every row it asks for, so
                    * only a fetch of one row tells which row it cannot read
                    * (none: the list is empty) */
};

/* The rows a fetch asks for, as PostgreSQL array literals: their ctids into
 * tids and, unless ids is NULL, their outbox_ids into ids, in the same order
 * (both reset first). Sets each row's `asked`. 0, or -1 out of memory. */
int batch_fetch_list(struct batch *b, enum fetch_ask ask, struct buf *tids, struct buf *ids)
        __attribute__((warn_unused_result));

/* Whether b has a row still to fetch that a failed fetch asked for. */
int batch_suspects(const struct batch *b);

/* Makes suspects of the rows still to fetch that b's latest fetch asked for
 * (it failed, or lost its connection): each is read alone from now on, until
 * read or settled. Returns how many. */
size_t batch_suspect_asked(struct batch *b);

/* Takes a fetch's answer (binary; relay/sql/fetch.sql) and fills the rows
 * it has: ROW_READY, or settled DEAD when a row cannot become a message
 * (larger than max_row bytes: MSG_SIZE_TOO_LARGE; occurred_at outside RFC
 * 3339's years: INVALID_VALUE). *bytes gets the bytes of the rows it holds,
 * *answered the size of every row the answer has (what fetch.sql's byte
 * limit counted: below that limit, no row was left out for it) but rows
 * found under the ctid of another of b's rows (that row moved). Rows it
 * lacks stay ROW_LOCKED (fetched again later, or looked up by outbox_id).
 * Returns how many rows it filled; -1 out of memory (the answer is freed). */
long batch_take_fetch(struct batch *b, struct db_result *r, long long max_row, long long *bytes,
                      long long *answered);

/* Settles row i with an outcome of `mark` (code static, msg copied and cut to
 * fit; both NULL for PUBLISHED and RELEASED). A row produced no more frees
 * its hold on the fetch it came in. */
void batch_settle(struct batch *b, size_t i, enum decide_mark mark, const char *code,
                  const char *msg);

/* Bytes the batch's live fetches hold (the byte budget's measure). */
long long batch_bytes(const struct batch *b);

/* Drops row i's hold on its fetch (it was produced: the producer copied the
 * message), freeing the fetch when no row needs it. */
void batch_release_content(struct batch *b, size_t i);

#endif
