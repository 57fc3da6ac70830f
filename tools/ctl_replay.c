/* ctl_replay.c - outboxctl replay: PUBLISHED rows back to PENDING, so the
 * relays publish them again in version order (docs/DESIGN.md, "Replaying").
 * The aggregates are selected once, then replayed in steps of
 * REPLAY_STEP aggregates, each its own transaction under the table lock. */
#include <stdio.h>
#include <time.h>

#include "clock.h"
#include "ctl.h"
#include "ctl_print.h"
#include "log.h"

/* Aggregates per step: a step holds the table lock (writers wait) while it
 * reads their ranges and moves their rows. */
#define REPLAY_STEP 500
/* Each lock attempt waits at most this long, so writers queued behind the
 * lock request wait no longer; a step retries for REPLAY_LOCK_GIVE_UP_S. */
#define REPLAY_LOCK_TIMEOUT_MS 2000
#define REPLAY_LOCK_GIVE_UP_S  60
#define PROGRESS_EVERY_S       5.0

/* Prints what was (or would be) done. Returns the rows refused. */
static long long report(const struct ctl_args *a, const struct db_replay_counts *c,
                        long long selected) {
        const char *verb = a->dry_run ? "would replay" : "replayed";
        printf("%s %lld row(s) of %lld aggregate(s)%s\n", verb, c->moved, c->moved_aggregates,
               c->moved ? ": PENDING, due now, published again in version order" : "");
        if (a->has_since && c->moved > selected)
                printf("  %lld selected by the window; %lld later version(s) of the same "
                       "aggregates with them (a replay runs to an aggregate's latest version)\n",
                       selected, c->moved - selected);
        long long refused = c->busy + c->below_release;
        if (c->busy)
                printf("refused %lld row(s) of %lld aggregate(s): a version of the aggregate is "
                       "being published now (PUBLISHING); run the replay again\n",
                       c->busy, c->busy_aggregates);
        if (c->below_release)
                printf("refused %lld row(s) below a released gap (GAP_RELEASED): they cannot "
                       "be sent again ahead of the release; replay from above it "
                       "(--from-version)\n",
                       c->below_release);
        if (c->unpublished) {
                /* With --aggregate these were asked for; with --since they are
                 * later versions not yet published, which follow in order. */
                printf("%s %lld row(s) not PUBLISHED (PENDING %lld, FAILED %lld, DEAD %lld, "
                       "PUBLISHING %lld)%s\n",
                       a->aggregate_id ? "refused" : "left", c->unpublished, c->pending, c->failed,
                       c->dead, c->publishing,
                       a->aggregate_id ? ": only PUBLISHED rows are replayed"
                                       : " as they are: they go after the replayed ones");
                if (a->aggregate_id)
                        refused += c->unpublished;
        }
        if (c->released)
                printf("left %lld GAP_RELEASED record(s): never sent, never replayed\n",
                       c->released);
        return refused;
}

/* One step, retrying while the table lock is not granted. */
static int run_step(struct ctl *c, long long first, long long last, struct db_replay_counts *sum,
                    char *err, size_t size) {
        double give_up = clock_mono_s() + REPLAY_LOCK_GIVE_UP_S;
        for (;;) {
                int timed_out = 0;
                if (db_replay_run(c->db, first, last, REPLAY_LOCK_TIMEOUT_MS, &timed_out, sum, err,
                                  size) != 0)
                        return -1;
                if (!timed_out)
                        return 0;
                if (clock_mono_s() > give_up) {
                        snprintf(err, size,
                                 "the table lock was not granted within %d s (a long transaction "
                                 "writing to the table?)",
                                 REPLAY_LOCK_GIVE_UP_S);
                        return -1;
                }
                log_warn("replay", "waiting for the table lock: writers in progress", "retry_ms=%d",
                         500);
                struct timespec ts = {0, 500 * 1000000L};
                nanosleep(&ts, NULL);
        }
}

int ctl_replay(struct ctl *c) {
        const struct ctl_args *a = c->args;
        char since[40], until[40], err[512];
        struct db_replay_counts sum = {0};
        struct db_rows *ex = NULL;
        long long aggregates = 0, selected = 0;
        int rc = 1;

        ctl_format_time(a->since_ms, since, sizeof since);
        ctl_format_time(a->until_ms, until, sizeof until);
        struct db_replay_select s = {a->tenant,   a->aggregate_type, a->aggregate_id,
                                     a->has_from, a->from_version,   since,
                                     until,       a->topics,         a->ntopics};
        if (db_replay_select(c->db, &s, &aggregates, &selected, err, sizeof err) != 0)
                goto fail;
        double start = clock_mono_s(), next_progress = start + PROGRESS_EVERY_S;
        for (long long first = 1; first <= aggregates; first += REPLAY_STEP) {
                long long last = first + REPLAY_STEP - 1;
                if (a->dry_run) {
                        /* examples from the first step that has any */
                        struct db_rows *step_ex = NULL;
                        int want = !ex || ex->nrows == 0;
                        if (db_replay_plan(c->db, first, last, want ? a->examples : 0, &sum,
                                           &step_ex, err, sizeof err) != 0)
                                goto fail;
                        if (step_ex) {
                                db_rows_free(ex);
                                ex = step_ex;
                        }
                } else if (run_step(c, first, last, &sum, err, sizeof err) != 0) {
                        goto fail;
                }
                if (clock_mono_s() >= next_progress) {
                        next_progress += PROGRESS_EVERY_S;
                        log_info("replay", a->dry_run ? "planning" : "replaying",
                                 "aggregates_done=%lld aggregates=%lld rows_moved=%lld",
                                 last < aggregates ? last : aggregates, aggregates, sum.moved);
                }
        }
        long long refused = report(a, &sum, selected);
        if (ex && ex->nrows > 0) {
                printf("\nfirst %d row(s) it would move:\n", ex->nrows);
                ctl_print_table(stdout, ex);
        }
        db_rows_free(ex);
        return refused > 0 ? 1 : 0;
fail:
        if (sum.moved)
                printf("replayed %lld row(s) of %lld aggregate(s) before the error\n", sum.moved,
                       sum.moved_aggregates);
        log_error("replay", "replay failed", "err=%s", err);
        db_rows_free(ex);
        return rc;
}
