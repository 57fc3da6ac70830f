/* decide.h - the relay's decisions, as pure functions: which versions of a
 * batch follow which (runs and waves), what a row's outcome makes of it
 * (PUBLISHED, FAILED with a backoff, DEAD), and how long to wait before
 * trying a failing statement again. No I/O, no clock, no globals: the loop
 * gives them what they need and acts on what they answer. */
#ifndef OUTBOX_DECIDE_H
#define OUTBOX_DECIDE_H

#include <stddef.h>

#include "config.h"

/* One locked row as the run decision sees it, in the batch's order (by
 * aggregate, then version). */
struct decide_item {
        int same_aggregate; /* the same aggregate as the item before it */
        long long version;
        int late; /* the lock said a later version is published already */
};

/* What the run decision makes of an item. */
struct decide_run {
        int prev;    /* index of the version this one waits for (acknowledged first), -1 none */
        int release; /* given back unattempted: it follows a hole in its aggregate's run */
};

/* Runs and waves (docs/DESIGN.md, "Per-aggregate order"). Under `aggregate`
 * an aggregate's rows form a run of consecutive versions (a repeated
 * version, another event type, continues it); a version after a hole is
 * given back with every later one of its aggregate (a gap: the lock
 * statement holds only whole ranges, so this is rare). Under `increasing`
 * any higher version continues the run. Each version of a run waits for the
 * one before it to be acknowledged: an idempotent producer keeps order within
 * a partition but may leave a gap when a message fails. Late rows and every
 * row under `none` wait for nothing. */
void decide_runs(enum config_ordering ordering, const struct decide_item *items, size_t n,
                 struct decide_run *out);

/* What a row's outcome makes of it. */
enum decide_mark {
        DECIDE_PUBLISHED = 0,
        DECIDE_FAILED,  /* due again after a backoff */
        DECIDE_DEAD,    /* parked for an operator */
        DECIDE_RELEASED /* given back unattempted (never produced) */
};

/* A row that was attempted and not acknowledged: DEAD when the error is
 * permanent, or its attempts are used up and this one counted, else FAILED. */
enum decide_mark decide_failure(int permanent, int uncounted, int attempt_count, int max_attempts);

/* The retry delay of a FAILED row (ms): exponential from initial_ms by
 * attempt (1: initial_ms), capped at max_ms, then jittered into [d/2, d]
 * with `random` (any unsigned value). */
long long decide_backoff_ms(int attempt, int initial_ms, int max_ms, unsigned random);

/* The wait before trying a statement again after `failures` failures in a
 * row (1 or more): 100 ms doubling, capped at cap_ms. */
int decide_retry_ms(int failures, int cap_ms);

/* Whether a fetch of one row that failed with SQLSTATE `sqlstate` says the
 * row cannot be read, so it goes DEAD: a data exception (class 22), a limit
 * the row's content exceeds (54) or damaged storage (XX001 data corrupted,
 * XX002 index corrupted; not XX000, any internal error). Anything else
 * (out of memory, a disk full, ...) is an attempt that failed: FAILED, and
 * tried again after its backoff. */
int decide_row_unreadable(const char *sqlstate);

#endif
