/* test_decide.c - the relay's decisions (relay/decide.c): runs and waves,
 * outcomes, backoff, statement retries. */
#include <criterion/criterion.h>
#include <limits.h>

#include "decide.h"

#define N(a) (sizeof(a) / sizeof((a)[0]))

/* Decides the runs of items and checks prev and release of each. */
static void expect_runs(enum config_ordering ordering, const struct decide_item *items, size_t n,
                        const int *prev, const int *release) {
        struct decide_run out[16];
        cr_assert(n <= N(out));
        decide_runs(ordering, items, n, out);
        for (size_t i = 0; i < n; i++) {
                cr_expect_eq(out[i].prev, prev[i], "item %zu: prev %d, want %d", i, out[i].prev,
                             prev[i]);
                cr_expect_eq(out[i].release, release[i], "item %zu: release %d, want %d", i,
                             out[i].release, release[i]);
        }
}

Test(decide, consecutive_versions_wait_one_for_the_other) {
        /* aggregate A: 3, 4, 5; aggregate B: 7 */
        struct decide_item items[] = {{0, 3, 0}, {1, 4, 0}, {1, 5, 0}, {0, 7, 0}};
        int prev[] = {-1, 0, 1, -1}, release[] = {0, 0, 0, 0};
        expect_runs(ORDERING_AGGREGATE, items, N(items), prev, release);
}

Test(decide, a_hole_gives_back_the_rest_of_its_aggregate_only) {
        /* A: 3, 5 (4 missing), 6; B: 1, 2 */
        struct decide_item items[] = {{0, 3, 0}, {1, 5, 0}, {1, 6, 0}, {0, 1, 0}, {1, 2, 0}};
        int prev[] = {-1, -1, -1, -1, 3}, release[] = {0, 1, 1, 0, 0};
        expect_runs(ORDERING_AGGREGATE, items, N(items), prev, release);
}

Test(decide, a_repeated_version_continues_the_run) {
        /* two event types at version 2, then 3 */
        struct decide_item items[] = {{0, 2, 0}, {1, 2, 0}, {1, 3, 0}};
        int prev[] = {-1, 0, 1}, release[] = {0, 0, 0};
        expect_runs(ORDERING_AGGREGATE, items, N(items), prev, release);
}

Test(decide, increasing_versions_may_skip) {
        struct decide_item items[] = {{0, 10, 0}, {1, 15, 0}, {1, 99, 0}};
        int prev[] = {-1, 0, 1}, release[] = {0, 0, 0};
        expect_runs(ORDERING_INCREASING, items, N(items), prev, release);
}

Test(decide, none_orders_nothing) {
        struct decide_item items[] = {{0, 1, 0}, {1, 2, 0}, {1, 9, 0}};
        int prev[] = {-1, -1, -1}, release[] = {0, 0, 0};
        expect_runs(ORDERING_NONE, items, N(items), prev, release);
}

Test(decide, late_rows_wait_for_nothing) {
        struct decide_item items[] = {{0, 1, 1}, {1, 2, 1}, {0, 5, 0}, {1, 6, 0}};
        int prev[] = {-1, -1, -1, 2}, release[] = {0, 0, 0, 0};
        expect_runs(ORDERING_AGGREGATE, items, N(items), prev, release);
}

Test(decide, the_edges_of_bigint_do_not_overflow) {
        struct decide_item items[] = {{0, LLONG_MIN, 0}, {1, LLONG_MIN, 0}, {1, LLONG_MIN + 1, 0},
                                      {0, LLONG_MAX, 0}, {1, LLONG_MAX, 0}, {0, LLONG_MAX - 1, 0},
                                      {1, LLONG_MAX, 0}};
        int prev[] = {-1, 0, 1, -1, 3, -1, 5}, release[] = {0, 0, 0, 0, 0, 0, 0};
        expect_runs(ORDERING_AGGREGATE, items, N(items), prev, release);
}

Test(decide, failures_go_dead_when_permanent_or_out_of_attempts) {
        cr_expect_eq(decide_failure(1, 0, 1, 10), DECIDE_DEAD);
        cr_expect_eq(decide_failure(0, 0, 9, 10), DECIDE_FAILED);
        cr_expect_eq(decide_failure(0, 0, 10, 10), DECIDE_DEAD);
        /* an attempt that does not count (the registry was down) never kills */
        cr_expect_eq(decide_failure(0, 1, 10, 10), DECIDE_FAILED);
        cr_expect_eq(decide_failure(0, 0, INT_MAX, 10), DECIDE_DEAD);
        cr_expect_eq(decide_failure(0, 0, INT_MIN, 10), DECIDE_FAILED);
}

Test(decide, backoff_doubles_to_its_cap_with_jitter_in_the_upper_half) {
        for (unsigned seed = 0; seed < 1000; seed += 7) {
                long long d1 = decide_backoff_ms(1, 1000, 300000, seed);
                cr_expect(d1 >= 500 && d1 <= 1000, "attempt 1: %lld", d1);
                long long d3 = decide_backoff_ms(3, 1000, 300000, seed);
                cr_expect(d3 >= 2000 && d3 <= 4000, "attempt 3: %lld", d3);
                long long big = decide_backoff_ms(INT_MAX, 1000, 300000, seed);
                cr_expect(big >= 150000 && big <= 300000, "attempt INT_MAX: %lld", big);
                long long none = decide_backoff_ms(INT_MIN, 1000, 300000, seed);
                cr_expect(none >= 500 && none <= 1000, "attempt INT_MIN: %lld", none);
        }
        cr_expect_eq(decide_backoff_ms(5, 1, 1, 12345), 1);
}

Test(decide, statement_retries_back_off_to_a_cap) {
        cr_expect_eq(decide_retry_ms(1, 30000), 100);
        cr_expect_eq(decide_retry_ms(2, 30000), 200);
        cr_expect_eq(decide_retry_ms(9, 30000), 25600);
        cr_expect_eq(decide_retry_ms(10, 30000), 30000);
        cr_expect_eq(decide_retry_ms(INT_MAX, 30000), 30000);
}

Test(decide, only_a_row_s_own_faults_make_it_unreadable) {
        cr_expect(decide_row_unreadable("22021"));  /* invalid byte sequence */
        cr_expect(decide_row_unreadable("22P02"));  /* invalid text representation */
        cr_expect(decide_row_unreadable("54000"));  /* program limit exceeded */
        cr_expect(decide_row_unreadable("XX001"));  /* data corrupted */
        cr_expect(decide_row_unreadable("XX002"));  /* index corrupted */
        cr_expect(!decide_row_unreadable("XX000")); /* internal error: anything */
        cr_expect(!decide_row_unreadable("53200")); /* out of memory */
        cr_expect(!decide_row_unreadable("53100")); /* disk full */
        cr_expect(!decide_row_unreadable("42501")); /* insufficient privilege */
        cr_expect(!decide_row_unreadable(""));
        cr_expect(!decide_row_unreadable("22"));
        cr_expect(!decide_row_unreadable(NULL));
}
