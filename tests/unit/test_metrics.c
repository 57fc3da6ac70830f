/* test_metrics.c - the metrics table renders docs/DESIGN.md's names and types, and
 * counters, gauges, histograms and labels behave as the exposition format wants. */
#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "encode.h"
#include "metrics.h"

/* A program name that is neither daemon: every metric is rendered. */
static void setup(void) {
        cr_assert_eq(metrics_init("outbox-test"), 0);
}

static void teardown(void) {
        metrics_destroy();
}

TestSuite(metrics, .init = setup, .fini = teardown, .timeout = 30);

/* The rendered exposition; caller frees. */
static char *render(void) {
        struct buf b = {0};
        cr_assert_eq(metrics_render(&b), 0);
        cr_assert_not_null(b.data);
        return b.data;
}

/* Value of the sample line starting with `series` + " " (NAN when absent). */
static double sample(const char *text, const char *series) {
        size_t n = strlen(series);
        for (const char *p = text; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL) {
                if (strncmp(p, series, n) == 0 && p[n] == ' ')
                        return strtod(p + n + 1, NULL);
        }
        return NAN;
}

static int count_prefix(const char *text, const char *prefix) {
        int n = 0;
        size_t len = strlen(prefix);
        for (const char *p = text; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL)
                if (strncmp(p, prefix, len) == 0)
                        n++;
        return n;
}

Test(metrics, every_design_name_with_its_type) {
        static const struct {
                const char *name, *type;
        } want[] = {
                {"outbox_events_published_total", "counter"},
                {"outbox_events_failed_total", "counter"},
                {"outbox_events_dead_total", "counter"},
                {"outbox_lock_lost_total", "counter"},
                {"outbox_batches_total", "counter"},
                {"outbox_publish_latency_seconds", "histogram"},
                {"outbox_batch_duration_seconds", "histogram"},
                {"outbox_event_size_bytes", "histogram"},
                {"outbox_events", "gauge"},
                {"outbox_oldest_pending_age_seconds", "gauge"},
                {"outbox_version_gaps", "gauge"},
                {"outbox_version_gap_age_seconds", "gauge"},
                {"outbox_relay_last_batch_timestamp_seconds", "gauge"},
                {"outbox_sweeper_stale_locks_reset_total", "counter"},
                {"outbox_sweeper_rows_deleted_total", "counter"},
                {"outbox_build_info", "gauge"},
                {"outbox_database_up", "gauge"},
                {"outbox_ready", "gauge"},
                {"outbox_statement_errors_total", "counter"},
                {"outbox_kafka_brokers_up", "gauge"},
                {"outbox_relay_last_lock_timestamp_seconds", "gauge"},
                {"outbox_relay_last_mark_timestamp_seconds", "gauge"},
                {"outbox_relay_stalled", "gauge"},
                {"outbox_oldest_transaction_age_seconds", "gauge"},
                {"outbox_oldest_due_age_seconds", "gauge"},
                {"outbox_held_aggregates", "gauge"},
                {"outbox_events_held", "gauge"},
                {"outbox_relay_events_locked_by_other", "gauge"},
                {"outbox_kafka_broker_rtt_p99_seconds", "gauge"},
                {"outbox_kafka_broker_inflight_requests", "gauge"},
                {"outbox_kafka_broker_outbuf_messages", "gauge"},
                {"outbox_kafka_retries_total", "counter"},
                {"outbox_kafka_errors_total", "counter"},
                {"outbox_kafka_queue_messages", "gauge"},
        };
        char *text = render();
        cr_assert_eq(count_prefix(text, "# TYPE "), (int)(sizeof want / sizeof want[0]));
        for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
                char line[256];
                snprintf(line, sizeof line, "# TYPE %s %s\n", want[i].name, want[i].type);
                cr_expect_not_null(strstr(text, line), "missing %s", line);
                snprintf(line, sizeof line, "# HELP %s ", want[i].name);
                cr_expect_not_null(strstr(text, line), "missing %s", line);
        }
        free(text);
}

Test(metrics, unlabelled_start_at_zero_labelled_start_empty) {
        char *text = render();
        cr_expect_eq(sample(text, "outbox_batches_total"), 0);
        cr_expect_eq(sample(text, "outbox_lock_lost_total"), 0);
        cr_expect_eq(sample(text, "outbox_oldest_pending_age_seconds"), 0);
        cr_expect_eq(sample(text, "outbox_relay_last_batch_timestamp_seconds"), 0);
        cr_expect_eq(sample(text, "outbox_sweeper_stale_locks_reset_total"), 0);
        cr_expect_eq(sample(text, "outbox_sweeper_rows_deleted_total"), 0);
        cr_expect_not_null(strstr(text, "\noutbox_batches_total 0\n"),
                           "integers print as integers");
        cr_expect_eq(count_prefix(text, "outbox_events_published_total"), 0);
        cr_expect_eq(count_prefix(text, "outbox_events{"), 0);
        cr_expect_eq(sample(text, "outbox_event_size_bytes_count"), 0);
        cr_expect_eq(sample(text, "outbox_event_size_bytes_bucket{le=\"+Inf\"}"), 0);
        free(text);
}

/* The readiness and held-row metrics read 0 before the loop sets them, and
 * both reasons of outbox_held_aggregates are there from the start. */
Test(metrics, new_metrics_start_at_zero) {
        static const char *const zero[] = {
                "outbox_database_up",
                "outbox_ready",
                "outbox_kafka_brokers_up",
                "outbox_relay_last_lock_timestamp_seconds",
                "outbox_relay_last_mark_timestamp_seconds",
                "outbox_relay_stalled",
                "outbox_oldest_transaction_age_seconds",
                "outbox_oldest_due_age_seconds",
                "outbox_held_aggregates{reason=\"gap\"}",
                "outbox_held_aggregates{reason=\"dead\"}",
                "outbox_events_held",
                "outbox_relay_events_locked_by_other",
                "outbox_kafka_retries_total",
                "outbox_kafka_errors_total",
                "outbox_kafka_queue_messages",
        };
        char *text = render();
        for (size_t i = 0; i < sizeof zero / sizeof zero[0]; i++)
                cr_expect_eq(sample(text, zero[i]), 0, "%s not 0 in\n%s", zero[i], text);
        cr_expect_eq(count_prefix(text, "outbox_held_aggregates{"), 2);
        cr_expect_eq(count_prefix(text, "outbox_statement_errors_total{"), 0);
        cr_expect_eq(count_prefix(text, "outbox_kafka_broker_"), 0);
        free(text);
}

Test(metrics, two_labels) {
        metrics_add2(M_STATEMENT_ERRORS, "lock_runs", "22003", 1);
        metrics_add2(M_STATEMENT_ERRORS, "lock_runs", "22003", 2);
        metrics_add2(M_STATEMENT_ERRORS, "lock_runs", "57014", 1);
        metrics_add2(M_STATEMENT_ERRORS, "mark", "22003", 1);
        metrics_add2(M_STATEMENT_ERRORS, NULL, "", 1);
        metrics_add(M_STATEMENT_ERRORS, "sample", 1); /* one label given: the other is "other" */
        metrics_add2(M_STATEMENT_ERRORS, "mark", "22003", -1); /* counters never go down */
        char *text = render();
        cr_expect_eq(
                sample(text,
                       "outbox_statement_errors_total{statement=\"lock_runs\",sqlstate=\"22003\"}"),
                3, "%s", text);
        cr_expect_eq(
                sample(text,
                       "outbox_statement_errors_total{statement=\"lock_runs\",sqlstate=\"57014\"}"),
                1);
        cr_expect_eq(sample(text,
                            "outbox_statement_errors_total{statement=\"mark\",sqlstate=\"22003\"}"),
                     1);
        cr_expect_eq(
                sample(text,
                       "outbox_statement_errors_total{statement=\"other\",sqlstate=\"other\"}"),
                1);
        cr_expect_eq(
                sample(text,
                       "outbox_statement_errors_total{statement=\"sample\",sqlstate=\"other\"}"),
                1);
        cr_expect_eq(count_prefix(text, "outbox_statement_errors_total{"), 5);
        free(text);
}

Test(metrics, two_labels_bounded) {
        char st[32];
        for (int i = 0; i < 100; i++) {
                snprintf(st, sizeof st, "s%d", i);
                metrics_add2(M_STATEMENT_ERRORS, st, "XX000", 1);
        }
        char *text = render();
        cr_expect_eq(count_prefix(text, "outbox_statement_errors_total{"), 64);
        cr_expect_eq(
                sample(text,
                       "outbox_statement_errors_total{statement=\"other\",sqlstate=\"other\"}"),
                37);
        free(text);
}

Test(metrics, replace_per_broker_gauges) {
        const char *ids[] = {"1", "2", "3"};
        double rtt[] = {0.004, 0.25, NAN};
        cr_assert_eq(metrics_replace(M_KAFKA_BROKER_RTT_P99, 3, ids, rtt), 0);
        char *text = render();
        cr_expect_eq(sample(text, "outbox_kafka_broker_rtt_p99_seconds{broker=\"1\"}"), 0.004);
        cr_expect_eq(sample(text, "outbox_kafka_broker_rtt_p99_seconds{broker=\"2\"}"), 0.25);
        cr_expect_eq(count_prefix(text, "outbox_kafka_broker_rtt_p99_seconds{"), 2, "NaN skipped");
        free(text);
        /* broker 1 left: its series goes */
        const char *ids2[] = {"2", "4"};
        double rtt2[] = {0.5, 0.001};
        cr_assert_eq(metrics_replace(M_KAFKA_BROKER_RTT_P99, 2, ids2, rtt2), 0);
        text = render();
        cr_expect(isnan(sample(text, "outbox_kafka_broker_rtt_p99_seconds{broker=\"1\"}")));
        cr_expect_eq(sample(text, "outbox_kafka_broker_rtt_p99_seconds{broker=\"2\"}"), 0.5);
        cr_expect_eq(sample(text, "outbox_kafka_broker_rtt_p99_seconds{broker=\"4\"}"), 0.001);
        free(text);
        /* 100 values: the first 64 are kept, no "other" */
        const char *many[100];
        double v[100];
        char names[100][8];
        for (int i = 0; i < 100; i++) {
                snprintf(names[i], sizeof names[i], "%d", i);
                many[i] = names[i];
                v[i] = i;
        }
        cr_assert_eq(metrics_replace(M_KAFKA_BROKER_INFLIGHT, 100, many, v), 0);
        metrics_set(M_KAFKA_BROKER_INFLIGHT, "200", 1); /* no slot left: ignored */
        text = render();
        cr_expect_eq(count_prefix(text, "outbox_kafka_broker_inflight_requests{"), 64);
        cr_expect_eq(sample(text, "outbox_kafka_broker_inflight_requests{broker=\"63\"}"), 63);
        cr_expect(isnan(sample(text, "outbox_kafka_broker_inflight_requests{broker=\"other\"}")));
        free(text);
        cr_assert_eq(metrics_replace(M_KAFKA_BROKER_OUTBUF, 0, NULL, NULL), 0);
        /* only one-label gauges */
        cr_expect_eq(metrics_replace(M_EVENTS_PUBLISHED, 1, ids, rtt), -1);
        cr_expect_eq(metrics_replace(M_OLDEST_DUE_AGE, 1, ids, rtt), -1);
        cr_expect_eq(metrics_replace(M_STATEMENT_ERRORS, 1, ids, rtt), -1);
        cr_expect_eq(metrics_replace(M_COUNT, 0, NULL, NULL), -1);
}

Test(metrics, build_info) {
        char *text = render();
        char want[160];
        snprintf(want, sizeof want,
                 "\noutbox_build_info{version=\"%s\",schema=\"%s\",program=\"outbox-test\"} 1\n",
                 OUTBOX_VERSION, OUTBOX_SCHEMA_LEVEL);
        cr_expect_not_null(strstr(text, want), "no %s in\n%s", want, text);
        free(text);
}

Test(metrics, counters_add) {
        metrics_add(M_BATCHES, NULL, 1);
        metrics_add(M_BATCHES, NULL, 2);
        metrics_add(M_BATCHES, NULL, -5); /* ignored: counters never go down */
        metrics_add(M_EVENTS_PUBLISHED, "orders", 2);
        metrics_add(M_EVENTS_PUBLISHED, "payments", 1);
        metrics_add(M_EVENTS_PUBLISHED, "orders", 1);
        metrics_add(M_EVENTS_FAILED, "_MSG_TIMED_OUT", 1);
        metrics_add(M_SWEEPER_DELETED, NULL, 1000);
        metrics_set(M_LOCK_LOST, NULL, 4);
        metrics_set(M_LOCK_LOST, NULL, 2); /* ignored: would lower a counter */
        char *text = render();
        cr_expect_not_null(strstr(text, "\noutbox_batches_total 3\n"));
        cr_expect_eq(sample(text, "outbox_events_published_total{topic=\"orders\"}"), 3);
        cr_expect_eq(sample(text, "outbox_events_published_total{topic=\"payments\"}"), 1);
        cr_expect_eq(sample(text, "outbox_events_failed_total{error_code=\"_MSG_TIMED_OUT\"}"), 1);
        cr_expect_eq(count_prefix(text, "outbox_events_dead_total{"), 0);
        cr_expect_eq(sample(text, "outbox_sweeper_rows_deleted_total"), 1000);
        cr_expect_eq(sample(text, "outbox_lock_lost_total"), 4);
        free(text);
}

Test(metrics, gauges_set) {
        metrics_set(M_OLDEST_PENDING_AGE, NULL, 12.5);
        metrics_set(M_OLDEST_PENDING_AGE, NULL, 3);
        metrics_set(M_LAST_BATCH_TIMESTAMP, NULL, 1700000000.25);
        metrics_set(M_EVENTS, "PENDING", 42);
        metrics_set(M_EVENTS, "DEAD", 1);
        metrics_set(M_EVENTS, "PENDING", 7);
        metrics_add(M_EVENTS, "DEAD", -1); /* gauges may go down */
        char *text = render();
        cr_expect_not_null(strstr(text, "\noutbox_oldest_pending_age_seconds 3\n"));
        cr_expect_not_null(
                strstr(text, "\noutbox_relay_last_batch_timestamp_seconds 1700000000.25\n"));
        cr_expect_not_null(strstr(text, "\noutbox_events{status=\"PENDING\"} 7\n"));
        cr_expect_not_null(strstr(text, "\noutbox_events{status=\"DEAD\"} 0\n"));
        free(text);
}

Test(metrics, histogram_buckets_cumulative) {
        metrics_observe(M_PUBLISH_LATENCY, 0.0005);
        metrics_observe(M_PUBLISH_LATENCY, 0.003);
        metrics_observe(M_PUBLISH_LATENCY, 0.2);
        metrics_observe(M_PUBLISH_LATENCY, 100); /* above the last bucket */
        metrics_observe(M_EVENT_SIZE, 64);       /* le is inclusive */
        metrics_observe(M_EVENT_SIZE, 65);
        metrics_observe(M_EVENT_SIZE, 5 * 1024 * 1024);
        metrics_observe(M_BATCHES, 1); /* not a histogram: ignored */
        char *text = render();
        const char *h = "outbox_publish_latency_seconds";
        char s[128];
#define B(le) (snprintf(s, sizeof s, "%s_bucket{le=\"%s\"}", h, le), sample(text, s))
        cr_expect_eq(B("0.001"), 1);
        cr_expect_eq(B("0.0025"), 1);
        cr_expect_eq(B("0.005"), 2);
        cr_expect_eq(B("0.1"), 2);
        cr_expect_eq(B("0.25"), 3);
        cr_expect_eq(B("60"), 3);
        cr_expect_eq(B("+Inf"), 4);
        snprintf(s, sizeof s, "%s_count", h);
        cr_expect_eq(sample(text, s), 4);
        snprintf(s, sizeof s, "%s_sum", h);
        cr_expect_float_eq(sample(text, s), 100.2035, 1e-9);

        h = "outbox_event_size_bytes";
        cr_expect_eq(B("64"), 1);
        cr_expect_eq(B("256"), 2);
        cr_expect_eq(B("4194304"), 2);
        cr_expect_eq(B("+Inf"), 3);
        h = "outbox_batch_duration_seconds";
        cr_expect_eq(B("120"), 0);
        cr_expect_eq(B("+Inf"), 0);
#undef B

        /* Every histogram's buckets are non-decreasing and end at _count. */
        const char *names[] = {"outbox_publish_latency_seconds", "outbox_batch_duration_seconds",
                               "outbox_event_size_bytes"};
        for (size_t i = 0; i < 3; i++) {
                char prefix[128];
                snprintf(prefix, sizeof prefix, "%s_bucket{le=\"", names[i]);
                double prev = -1, last_le = -1;
                int n = 0;
                for (const char *p = strstr(text, prefix); p; p = strstr(p + 1, prefix)) {
                        const char *le = p + strlen(prefix);
                        double le_v = strncmp(le, "+Inf", 4) == 0 ? INFINITY : strtod(le, NULL);
                        double v = strtod(strchr(p, ' ') + 1, NULL);
                        cr_expect_gt(le_v, last_le, "%s le not increasing", names[i]);
                        cr_expect_geq(v, prev, "%s buckets not cumulative", names[i]);
                        prev = v;
                        last_le = le_v;
                        n++;
                }
                cr_expect_gt(n, 5);
                cr_expect(isinf(last_le), "%s lacks +Inf", names[i]);
                snprintf(prefix, sizeof prefix, "%s_count", names[i]);
                cr_expect_eq(prev, sample(text, prefix));
        }
        free(text);
}

Test(metrics, label_values_escaped) {
        metrics_add(M_EVENTS_PUBLISHED, "a\"b\\c\nd", 1);
        char *text = render();
        cr_expect_not_null(
                strstr(text, "\noutbox_events_published_total{topic=\"a\\\"b\\\\c\\nd\"} 1\n"),
                "%s", text);
        free(text);
}

Test(metrics, label_overflow_goes_to_other) {
        char label[32];
        for (int i = 0; i < 100; i++) {
                snprintf(label, sizeof label, "ERR_%d", i);
                metrics_add(M_EVENTS_FAILED, label, 1);
        }
        metrics_add(M_EVENTS_FAILED, "ERR_0", 1); /* still its own series */
        metrics_add(M_EVENTS_FAILED, NULL, 1);    /* no value: other */
        metrics_add(M_EVENTS_DEAD, "ERR_99", 1);  /* bounds are per metric */
        char *text = render();
        cr_expect_eq(count_prefix(text, "outbox_events_failed_total{"), 64);
        cr_expect_eq(sample(text, "outbox_events_failed_total{error_code=\"ERR_0\"}"), 2);
        cr_expect_eq(sample(text, "outbox_events_failed_total{error_code=\"ERR_62\"}"), 1);
        cr_expect(isnan(sample(text, "outbox_events_failed_total{error_code=\"ERR_63\"}")));
        cr_expect_eq(sample(text, "outbox_events_failed_total{error_code=\"other\"}"), 37 + 1);
        cr_expect_eq(sample(text, "outbox_events_dead_total{error_code=\"ERR_99\"}"), 1);
        free(text);
}

Test(metrics, long_label_cut) {
        char label[1024];
        memset(label, 'x', sizeof label - 1);
        label[sizeof label - 1] = '\0';
        metrics_add(M_EVENTS_PUBLISHED, label, 1);
        metrics_add(M_EVENTS_PUBLISHED, label, 1);
        char *text = render();
        cr_expect_eq(count_prefix(text, "outbox_events_published_total{"), 1);
        free(text);
}

Test(metrics, every_line_parses) {
        metrics_add(M_EVENTS_PUBLISHED, "orders", 1);
        metrics_set(M_LAST_BATCH_TIMESTAMP, NULL, 1700000000.123);
        metrics_observe(M_BATCH_DURATION, 0.1);
        char *text = render();
        char *save = NULL;
        for (char *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
                if (line[0] == '#') {
                        cr_expect(strncmp(line, "# HELP outbox_", 14) == 0 ||
                                          strncmp(line, "# TYPE outbox_", 14) == 0,
                                  "bad comment: %s", line);
                        continue;
                }
                cr_expect_eq(strncmp(line, "outbox_", 7), 0, "bad name: %s", line);
                char *sp = strrchr(line, ' ');
                cr_assert_not_null(sp, "no value: %s", line);
                char *end = NULL;
                (void)strtod(sp + 1, &end);
                cr_expect(end && *end == '\0' && end != sp + 1, "bad value: %s", line);
        }
        free(text);
}

static void *adder(void *arg) {
        (void)arg;
        for (int i = 0; i < 10000; i++) {
                metrics_add(M_BATCHES, NULL, 1);
                metrics_add(M_EVENTS_PUBLISHED, i % 2 ? "a" : "b", 1);
                metrics_observe(M_BATCH_DURATION, 0.01);
        }
        return NULL;
}

Test(metrics, concurrent_updates_and_renders) {
        pthread_t t[4];
        for (int i = 0; i < 4; i++)
                cr_assert_eq(pthread_create(&t[i], NULL, adder, NULL), 0);
        for (int i = 0; i < 20; i++)
                free(render());
        for (int i = 0; i < 4; i++)
                cr_assert_eq(pthread_join(t[i], NULL), 0);
        char *text = render();
        cr_expect_eq(sample(text, "outbox_batches_total"), 40000);
        cr_expect_eq(sample(text, "outbox_events_published_total{topic=\"a\"}"), 20000);
        cr_expect_eq(sample(text, "outbox_batch_duration_seconds_count"), 40000);
        free(text);
}

Test(metrics, render_appends) {
        struct buf b = {0};
        cr_assert_eq(buf_append(&b, "x\n", 2), 0);
        cr_assert_eq(metrics_render(&b), 0);
        cr_expect_eq(strncmp(b.data, "x\n# HELP ", 9), 0);
        buf_free(&b);
}

/* Each daemon exposes its own metrics only (plus build_info). */
Test(metrics, per_program_sets) {
        cr_assert_eq(metrics_init("outbox-sweeper"), 0);
        char *text = render();
        cr_expect_not_null(strstr(text, "\noutbox_sweeper_rows_deleted_total 0\n"));
        cr_expect_not_null(strstr(text, "\noutbox_sweeper_stale_locks_reset_total 0\n"));
        cr_expect_not_null(strstr(text, "program=\"outbox-sweeper\"} 1\n"));
        cr_expect_null(strstr(text, "outbox_relay_last_batch_timestamp_seconds"));
        cr_expect_null(strstr(text, "outbox_batches_total"));
        cr_expect_null(strstr(text, "outbox_kafka_"));
        cr_expect_null(strstr(text, "outbox_held_aggregates"));
        cr_expect_not_null(strstr(text, "\noutbox_database_up 0\n"));
        cr_expect_not_null(strstr(text, "\noutbox_ready 0\n"));
        cr_expect_not_null(strstr(text, "# TYPE outbox_statement_errors_total counter\n"));
        cr_expect_eq(count_prefix(text, "# TYPE "), 6);
        free(text);
        cr_assert_eq(metrics_init("outbox-relay"), 0);
        text = render();
        cr_expect_not_null(strstr(text, "\noutbox_relay_last_batch_timestamp_seconds 0\n"));
        cr_expect_null(strstr(text, "outbox_sweeper_"));
        cr_expect_not_null(strstr(text, "\noutbox_database_up 0\n"));
        cr_expect_not_null(strstr(text, "\noutbox_relay_stalled 0\n"));
        cr_expect_eq(count_prefix(text, "# TYPE "), 32);
        free(text);
}
