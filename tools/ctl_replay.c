/* ctl_replay.c - outboxctl replay: PUBLISHED rows back to PENDING, so the
 * relays publish them again in version order (docs/DESIGN.md, "Replaying").
 * The aggregates are selected once, then replayed in steps of REPLAY_STEP
 * aggregates. A step locks rows, never the table: it holds the rows it
 * moves (PUBLISHING, for no relay), then makes them PENDING once no lock
 * statement that began before the hold can publish a version it did not
 * see. */
#include <stdio.h>
#include <time.h>

#include "clock.h"
#include "ctl.h"
#include "ctl_print.h"
#include "log.h"

/* Aggregates per step: a step's two statements lock their rows while they
 * read and move them (relays pass them by; their marks of rows there wait). */
#define REPLAY_STEP 500
/* The longest a statement of a step waits for a row another transaction
 * holds (a lock statement or a mark in progress): below the server's
 * deadlock_timeout (1 s by default), so that should a mark wait for this
 * step while it waits for the mark, this step gives up first. */
#define REPLAY_LOCK_TIMEOUT_MS 200
/* A step whose rows stay locked retries for this long, then fails. */
#define REPLAY_GIVE_UP_S 60
/* The second half waits this long for a version being published (locked
 * by a lock statement that began before the hold) to be marked; then the
 * held rows go back as they were, refused. */
#define REPLAY_RELEASE_WAIT_S 10
#define RETRY_MS              100
#define PROGRESS_EVERY_S      5.0

static void pause_ms(long ms) {
        struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
}

/* The refused rows. */
static long long refused_rows(const struct ctl_args *a, const struct db_replay_counts *c) {
        return c->busy + c->below_release + (a->aggregate_id ? c->unpublished : 0);
}

/* Prints what was (or would be) done, as text. */
static void report(const struct ctl_args *a, const struct db_replay_counts *c, long long selected) {
        const char *verb = a->dry_run ? "would replay" : "replayed";
        printf("%s %lld row(s) of %lld aggregate(s)%s\n", verb, c->moved, c->moved_aggregates,
               c->moved ? ": PENDING, due now, published again in version order" : "");
        if (a->has_since && c->moved > selected)
                printf("  %lld selected by the window; %lld later version(s) of the same "
                       "aggregates with them (a replay runs to an aggregate's latest version)\n",
                       selected, c->moved - selected);
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
        }
        if (c->released)
                printf("left %lld GAP_RELEASED record(s): never sent, never replayed\n",
                       c->released);
}

/* The one JSON object of --json. */
static int print_json(const struct ctl_args *a, const struct db_replay_counts *c,
                      long long aggregates, long long selected, const struct db_rows *ex) {
        struct buf b = {0};
        char since[40], until[40];
        int rc = buf_appendf(&b, "{\"dry_run\": %s, ", a->dry_run ? "true" : "false");
        if (a->aggregate_id) {
                rc = rc ? rc : buf_appendf(&b, "\"tenant_id\": ");
                rc = rc ? rc : buf_append_json_string(&b, a->tenant);
                rc = rc ? rc : buf_appendf(&b, ", \"aggregate_type\": ");
                rc = rc ? rc : buf_append_json_string(&b, a->aggregate_type);
                rc = rc ? rc : buf_appendf(&b, ", \"aggregate_id\": ");
                rc = rc ? rc : buf_append_json_string(&b, a->aggregate_id);
                rc = rc ? rc : buf_appendf(&b, ", \"from_version\": ");
                rc = rc ? rc
                        : (a->has_from ? buf_appendf(&b, "%lld", a->from_version)
                                       : buf_appendf(&b, "null"));
        } else {
                ctl_format_time(a->since_ms, since, sizeof since);
                ctl_format_time(a->until_ms, until, sizeof until);
                rc = rc ? rc
                        : buf_appendf(&b, "\"since\": \"%s\", \"until\": \"%s\", ", since, until);
                rc = rc ? rc : buf_appendf(&b, "\"topics\": [");
                for (size_t i = 0; rc == 0 && i < a->ntopics; i++) {
                        rc = i ? buf_append(&b, ", ", 2) : 0;
                        rc = rc ? rc : buf_append_json_string(&b, a->topics[i]);
                }
                rc = rc ? rc : buf_appendf(&b, "]");
        }
        rc = rc ? rc
                : buf_appendf(&b,
                              ", \"aggregates\": %lld, \"selected\": %lld, \"moved\": %lld, "
                              "\"moved_aggregates\": %lld, \"busy\": %lld, "
                              "\"busy_aggregates\": %lld, \"below_release\": %lld, "
                              "\"gap_released\": %lld, \"unpublished\": {\"PENDING\": %lld, "
                              "\"FAILED\": %lld, \"DEAD\": %lld, \"PUBLISHING\": %lld}, "
                              "\"refused\": %lld, \"examples\": ",
                              aggregates, selected, c->moved, c->moved_aggregates, c->busy,
                              c->busy_aggregates, c->below_release, c->released, c->pending,
                              c->failed, c->dead, c->publishing, refused_rows(a, c));
        if (ex)
                rc = rc ? rc : ctl_json_rows(&b, ex);
        else
                rc = rc ? rc : buf_appendf(&b, "[]");
        rc = rc ? rc : buf_appendf(&b, "}\n");
        if (rc == 0)
                fwrite(b.data, 1, b.len, stdout);
        buf_free(&b);
        return rc;
}

/* A step's first half: holds the rows it moves, retrying while a row stays
 * locked. */
static int hold(struct ctl *c, long long first, long long last, struct db_replay_counts *sum,
                char *err, size_t size) {
        double give_up = clock_mono_s() + REPLAY_GIVE_UP_S;
        for (;;) {
                int busy = 0;
                if (db_replay_hold(c->db, first, last, REPLAY_LOCK_TIMEOUT_MS, &busy, sum, err,
                                   size) != 0)
                        return -1;
                if (!busy)
                        return 0;
                if (clock_mono_s() > give_up) {
                        snprintf(err, size,
                                 "rows stayed locked by other transactions for %d s (a long "
                                 "transaction updating the table?)",
                                 REPLAY_GIVE_UP_S);
                        return -1;
                }
                log_debug("replay", "rows locked by another transaction: retrying", "retry_ms=%d",
                          RETRY_MS);
                pause_ms(RETRY_MS);
        }
}

/* The second half: makes the held rows due, waiting for versions being
 * published to be marked, up to REPLAY_RELEASE_WAIT_S; what is still held
 * then goes back as it was, counted as refused. */
static int release(struct ctl *c, long long first, long long last, struct db_replay_counts *sum,
                   char *err, size_t size) {
        double start = clock_mono_s();
        for (;;) {
                int busy = 0;
                struct db_replay_release r;
                if (db_replay_release(c->db, first, last, &busy, &r, err, size) != 0)
                        return -1;
                if (!busy) {
                        sum->moved += r.late;
                        if (r.busy_aggregates == 0)
                                return 0;
                }
                if (clock_mono_s() - start > REPLAY_RELEASE_WAIT_S)
                        break;
                pause_ms(RETRY_MS);
        }
        long long rows, aggregates;
        if (db_replay_undo(c->db, first, last, &rows, &aggregates, err, size) != 0)
                return -1;
        log_warn("replay", "a version was being published for too long: rows given back",
                 "rows=%lld aggregates=%lld wait_s=%d", rows, aggregates, REPLAY_RELEASE_WAIT_S);
        sum->moved -= rows;
        sum->moved_aggregates -= aggregates;
        sum->busy += rows;
        sum->busy_aggregates += aggregates;
        return 0;
}

int ctl_replay(struct ctl *c) {
        const struct ctl_args *a = c->args;
        char since[40], until[40], err[512];
        struct db_replay_counts sum = {0};
        struct db_rows *ex = NULL;
        long long aggregates = 0, selected = 0;
        long long held = 0; /* rows the current step holds, not yet released */

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
                } else {
                        long long before = sum.moved;
                        if (hold(c, first, last, &sum, err, sizeof err) != 0)
                                goto fail;
                        held = sum.moved - before;
                        /* test hook (OUTBOX_TEST_REPLAY_PAUSE_MS; 0 in other builds) */
                        if (c->cfg->test_replay_pause_ms > 0)
                                pause_ms(c->cfg->test_replay_pause_ms);
                        if (release(c, first, last, &sum, err, sizeof err) != 0)
                                goto fail;
                        held = 0;
                }
                if (clock_mono_s() >= next_progress) {
                        next_progress += PROGRESS_EVERY_S;
                        log_info("replay", a->dry_run ? "planning" : "replaying",
                                 "aggregates_done=%lld aggregates=%lld rows_moved=%lld",
                                 last < aggregates ? last : aggregates, aggregates, sum.moved);
                }
        }
        if (a->json) {
                if (print_json(a, &sum, aggregates, selected, ex) != 0) {
                        snprintf(err, sizeof err, "out of memory");
                        goto fail;
                }
        } else {
                report(a, &sum, selected);
                if (ex && ex->nrows > 0) {
                        printf("\nfirst %d row(s) it would move:\n", ex->nrows);
                        ctl_print_table(stdout, ex);
                }
        }
        db_rows_free(ex);
        return refused_rows(a, &sum) > 0 ? 1 : 0;
fail:
        if (sum.moved - held > 0)
                printf("replayed %lld row(s) before the error\n", sum.moved - held);
        log_error("replay", "replay failed", "err=%s", err);
        if (held > 0)
                log_warn("replay",
                         "rows held by this replay stay PUBLISHING until the sweeper takes them "
                         "back (OUTBOX_LOCK_TIMEOUT_S); then they are published in order",
                         "rows=%lld locked_by=%s", held, "outboxctl replay");
        db_rows_free(ex);
        return 1;
}
