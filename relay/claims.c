/* claims.c - the batches a relay holds, from lock to mark. */
#include "claims.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "lifecycle.h"
#include "log.h"
#include "metrics.h"

/* After a stop request, how long marking and taking back may keep retrying a
 * lost database (then the sweeper returns what is left). */
#define STOP_GRACE_S 30.0
/* A batch locked ahead goes out only if its lock is at most this old; older
 * (the batch before it waited for a broker), it is given back unproduced and
 * locked again later, so no lock lives much longer than one batch's delivery
 * timeout (which OUTBOX_LOCK_TIMEOUT_S must outlast). */
#define AHEAD_MAX_AGE_S 5.0
/* After a lock ahead found nothing, how long not to try again. */
#define AHEAD_PAUSE_S 1.0
/* After a top-up that found nothing, how long not to try again: its scan
 * steps over every blocked row. */
#define TOPUP_PAUSE_S 1.0

struct claims {
        const struct config *cfg;
        struct db *db;
        struct http *http;
        struct db_batch batch;   /* being published */
        struct db_batch ahead;   /* locked while `batch` was published; none at count 0 */
        struct db_outcome *outs; /* of `batch`, or of `ahead` when it goes back */
        double ahead_sent;       /* when the last lock ahead was sent (monotonic) */
        double ahead_locked_at;  /* when the lock statement of `ahead` was sent */
        double ahead_after;      /* no lock ahead before this */
        double topup_after;      /* no top-up before this */
        int unknown;             /* a lock statement may have locked rows no batch has */
        long seen_connects;      /* db_connects() when own locks were last taken back */
        int reconnect_ms;        /* backoff of the next reconnect */
        double stop_deadline;    /* set at the first retry after a stop request */
        int left_behind;         /* rows stay PUBLISHING for the sweeper */
        double row_bytes;        /* recent rows' average size in bytes (0: none yet) */
};

struct claims *claims_new(const struct config *cfg, struct db *db, struct http *http, char *errstr,
                          size_t errstr_size) {
        struct claims *c = calloc(1, sizeof *c);
        if (c)
                c->outs = calloc((size_t)cfg->batch_size, sizeof *c->outs);
        if (!c || !c->outs) {
                free(c);
                snprintf(errstr, errstr_size, "out of memory");
                return NULL;
        }
        c->cfg = cfg;
        c->db = db;
        c->http = http;
        c->reconnect_ms = LIFECYCLE_RECONNECT_MIN_MS;
        return c;
}

void claims_destroy(struct claims *c) {
        if (!c)
                return;
        db_batch_clear(&c->batch);
        db_batch_clear(&c->ahead);
        free(c->outs);
        free(c);
}

/* Connects if needed; on failure waits the backoff and returns -1. */
static int ensure_db(struct claims *c, volatile sig_atomic_t *stop) {
        return lifecycle_ensure_db(c->db, &c->reconnect_ms, c->http, stop);
}

/* After a stop request, between retries of the database: 1 once
 * STOP_GRACE_S have passed since the first such retry (one grace for the
 * whole stop), else pauses briefly and returns 0. */
static int stop_grace_over(struct claims *c) {
        if (c->stop_deadline == 0)
                c->stop_deadline = clock_mono_s() + STOP_GRACE_S;
        else if (clock_mono_s() > c->stop_deadline)
                return 1;
        struct timespec ts = {0, LIFECYCLE_STOP_RETRY_MS * 1000000L};
        nanosleep(&ts, NULL);
        return 0;
}

/* Marks the first n outcomes, retrying through database outages: rows must
 * not stay PUBLISHING. After a stop request it gives up after STOP_GRACE_S. */
static int mark(struct claims *c, size_t n, volatile sig_atomic_t *stop) {
        char err[512];
        for (;;) {
                size_t lost = 0;
                if (ensure_db(c, stop) == 0 &&
                    db_mark(c->db, c->outs, n, &lost, err, sizeof err) == 0) {
                        if (lost) {
                                metrics_add(M_LOCK_LOST, NULL, (double)lost);
                                log_warn("relay", "locks lost before marking", "rows=%zu", lost);
                        }
                        c->reconnect_ms = LIFECYCLE_RECONNECT_MIN_MS;
                        return 0;
                }
                if (db_connected(c->db)) {
                        /* connected but failing: wait like a reconnect would */
                        log_warn("db", "mark failed, retrying", "retry_ms=%d err=%s",
                                 lifecycle_retry_ms(c->reconnect_ms, stop), err);
                        lifecycle_backoff(c->http, &c->reconnect_ms, stop);
                }
                if (*stop && stop_grace_over(c)) {
                        log_error("relay", "cannot mark the batch before stopping", "rows=%zu", n);
                        return -1;
                }
        }
}

/* Learns the size of the rows a lock statement brought (their average,
 * half-weighted against the rows before). */
static void learn_row_bytes(struct claims *c, size_t rows, size_t bytes) {
        if (!rows)
                return;
        double avg = (double)bytes / (double)rows;
        c->row_bytes = c->row_bytes > 0 ? (c->row_bytes + avg) / 2 : avg;
}

/* How many rows a lock statement asks for: at most `limit`, and about twice
 * as many as `bytes` holds at the recent rows' size. The statement makes
 * every chosen row's text before the byte budget cuts, so with large rows
 * asking for OUTBOX_BATCH_SIZE would make the text of hundreds of rows to
 * keep a few (900 kB rows: 70 ms of the server's CPU per row kept). */
static int rows_for(const struct claims *c, int limit, long long bytes) {
        if (c->row_bytes <= 0)
                return limit;
        double n = (double)bytes / c->row_bytes * 2 + 1;
        return n < limit ? (int)n : limit;
}

/* Runs a lock statement into b, noting rows it may have locked that b did
 * not get. */
static int lock(struct claims *c, enum db_lock_kind kind, int limit, long long bytes,
                struct db_batch *b, char *err, size_t err_size) {
        int unknown = 0;
        size_t rows = b->count, had = b->bytes;
        int rc = db_lock(c->db, kind, rows_for(c, limit, bytes), bytes, b, &unknown, err, err_size);
        c->unknown |= unknown;
        learn_row_bytes(c, b->count - rows, b->bytes - had);
        return rc;
}

/* What the next lock statement may add: OUTBOX_BATCH_BYTES less what the
 * batch being published and the one locked ahead hold (both count against
 * it; each statement takes at least one row while this is positive). */
static long long bytes_left(const struct claims *c) {
        return c->cfg->batch_bytes - (long long)(c->batch.bytes + c->ahead.bytes);
}

/* What the batch being formed may still add: its half of the budget, so
 * that the batch locked ahead while it is published gets the other half and
 * the two overlap, whatever the rows' size. */
static long long batch_bytes_left(const struct claims *c) {
        long long own = c->cfg->batch_bytes / 2 - (long long)c->batch.bytes;
        long long all = bytes_left(c);
        return own < all ? own : all;
}

/* The window's lock statement: with the per-aggregate guard, or without. */
static enum db_lock_kind window(const struct claims *c) {
        return c->cfg->ordering == ORDERING_NONE ? DB_LOCK_WINDOW : DB_LOCK_RUNS;
}

/* Gives the batch locked ahead back unproduced (DB_MARK_RELEASED: the
 * attempt does not count). -1 when it could not be marked before a stop. */
/* Tells lifecycle how many rows the relay holds now (the line a second stop
 * signal writes says so). */
static void report_held(const struct claims *c) {
        lifecycle_set_rows_held((long)(c->batch.count + c->ahead.count));
}

static int release_ahead(struct claims *c, volatile sig_atomic_t *stop) {
        size_t n = c->ahead.count;
        for (size_t i = 0; i < n; i++) {
                memset(&c->outs[i], 0, sizeof c->outs[i]);
                c->outs[i].outbox_id = c->ahead.events[i].outbox_id;
                c->outs[i].mark = DB_MARK_RELEASED;
        }
        int rc = mark(c, n, stop);
        if (rc != 0)
                c->left_behind = 1;
        db_batch_clear(&c->ahead);
        report_held(c);
        return rc;
}

/* Takes back what this relay id holds beyond its batches (docs/DESIGN.md,
 * "Status machine" step 6). */
static int take_back_own(struct claims *c) {
        char err[512];
        long long n;
        if (db_take_back_own(c->db, c->cfg->max_attempts, &n, err, sizeof err) != 0) {
                log_warn("db", "taking back own locks failed", "err=%s", err);
                return -1;
        }
        c->seen_connects = db_connects(c->db);
        c->unknown = 0;
        if (n)
                log_warn("relay", "took back rows locked under this relay id", "rows=%lld", n);
        return 0;
}

/* Whether this relay id may hold rows no batch has: the connection was
 * replaced since own locks were last taken back, or a lock statement's rows
 * were lost. */
static int may_hold_unknown(const struct claims *c) {
        return db_connects(c->db) != c->seen_connects || c->unknown;
}

int claims_ready(struct claims *c, volatile sig_atomic_t *stop) {
        if (ensure_db(c, stop) != 0)
                return -1;
        if (!may_hold_unknown(c))
                return 0;
        /* The batch locked ahead is still this relay's (the mark is fenced),
         * so it goes back unattempted first; the take-back gets the rest. */
        if ((c->ahead.count && release_ahead(c, stop) != 0) || take_back_own(c) != 0) {
                lifecycle_nap(c->http, c->cfg->poll_interval_ms, stop);
                return -1;
        }
        return 0;
}

/* Moves the batch locked ahead into c->batch when it may still go out; 1 if
 * it did. Its connection is the one it was locked on: after a reconnect,
 * claims_ready() gave it back before any batch ran. */
static int take_ahead(struct claims *c, volatile sig_atomic_t *stop) {
        if (!c->ahead.count)
                return 0;
        if (*stop) {
                release_ahead(c, stop); /* a stopping relay publishes no new batch */
                return 0;
        }
        if (clock_mono_s() - c->ahead_locked_at > AHEAD_MAX_AGE_S) {
                log_warn("relay", "releasing a batch locked ahead: held too long", "rows=%zu",
                         c->ahead.count);
                release_ahead(c, stop);
                return 0;
        }
        c->batch = c->ahead;
        memset(&c->ahead, 0, sizeof c->ahead);
        /* Locked ahead, the batch may have come short: versions whose
         * predecessors were still in flight. Now that those may be marked,
         * fill it up (each batch costs a produce request per partition). */
        int room = c->cfg->batch_size - (int)c->batch.count;
        if (room > 0 && batch_bytes_left(c) > 0 && db_connected(c->db)) {
                char err[512];
                if (lock(c, window(c), room, batch_bytes_left(c), &c->batch, err, sizeof err) != 0)
                        log_warn("db", "filling up a batch locked ahead failed", "err=%s", err);
        }
        return 1;
}

/* Locks a batch now. Under the guard a short one is topped up with the heads
 * of aggregates the window did not reach (it may have been full of blocked
 * versions); if that fails, the batch goes too (its rows stay PUBLISHING
 * until taken back). */
static int lock_now(struct claims *c) {
        char err[512];
        int limit = c->cfg->batch_size;
        if (lock(c, window(c), limit, batch_bytes_left(c), &c->batch, err, sizeof err) != 0)
                goto fail;
        size_t got = c->batch.count;
        if (window(c) == DB_LOCK_RUNS && got < (size_t)limit && batch_bytes_left(c) > 0 &&
            clock_mono_s() >= c->topup_after) {
                if (lock(c, DB_LOCK_HEADS, limit - (int)got, batch_bytes_left(c), &c->batch, err,
                         sizeof err) != 0) {
                        c->unknown = 1;
                        db_batch_clear(&c->batch);
                        goto fail;
                }
                if (c->batch.count == got)
                        c->topup_after = clock_mono_s() + TOPUP_PAUSE_S;
        }
        return 0;
fail:
        log_warn("db", "lock batch failed", "err=%s", err);
        return -1;
}

/* Sends the lock statement of the batch after c->batch, to be collected by
 * claims_receive_ahead() while c->batch is published. The guard keeps the
 * two apart: no later version of c->batch's aggregates is ready meanwhile. */
static void lock_ahead(struct claims *c, volatile sig_atomic_t *stop) {
        char err[512];
        c->ahead_sent = clock_mono_s();
        if (*stop || c->ahead_sent < c->ahead_after || bytes_left(c) <= 0)
                return;
        if (db_lock_send(c->db, window(c), rows_for(c, c->cfg->batch_size, bytes_left(c)),
                         bytes_left(c), err, sizeof err) != 0)
                log_warn("db", "locking the next batch ahead failed", "err=%s", err);
}

int claims_lock(struct claims *c, volatile sig_atomic_t *stop, const struct db_batch **batch) {
        *batch = &c->batch;
        if (!take_ahead(c, stop)) {
                if (*stop)
                        return 0; /* giving the batch locked ahead back took the stop */
                if (lock_now(c) != 0)
                        return -1;
        }
        if (c->batch.count)
                lock_ahead(c, stop);
        report_held(c);
        return 0;
}

int claims_ahead_pending(const struct claims *c) {
        return db_lock_in_flight(c->db);
}

int claims_poll_ahead(void *claims) {
        struct claims *c = claims;
        return db_lock_poll(c->db);
}

void claims_receive_ahead(struct claims *c) {
        char err[512];
        int unknown = 0;
        if (!db_lock_in_flight(c->db))
                return;
        int rc = db_lock_receive(c->db, &c->ahead, &unknown, err, sizeof err);
        c->unknown |= unknown;
        if (rc != 0) {
                log_warn("db", "locking the next batch ahead failed", "err=%s", err);
                return;
        }
        learn_row_bytes(c, c->ahead.count, c->ahead.bytes);
        if (c->ahead.count == 0)
                c->ahead_after = clock_mono_s() + AHEAD_PAUSE_S;
        c->ahead_locked_at = c->ahead_sent;
        report_held(c);
}

struct db_outcome *claims_outcomes(struct claims *c) {
        return c->outs;
}

int claims_settle(struct claims *c, size_t n, volatile sig_atomic_t *stop) {
        int rc = mark(c, n, stop);
        if (rc != 0)
                c->left_behind = 1;
        db_batch_clear(&c->batch);
        report_held(c);
        return rc;
}

void claims_finish(struct claims *c, volatile sig_atomic_t *stop) {
        if (c->ahead.count)
                release_ahead(c, stop);
        while (may_hold_unknown(c)) {
                if (ensure_db(c, stop) == 0 && take_back_own(c) == 0)
                        break;
                if (stop_grace_over(c)) {
                        log_error("relay", "rows a lost lock statement may hold stay PUBLISHING",
                                  "relay_id=%s", c->cfg->relay_id);
                        c->left_behind = 1;
                        break;
                }
        }
}

int claims_left_behind(const struct claims *c) {
        return c->left_behind;
}
