/* test_kafka_stats.c - librdkafka statistics JSON: statistics recorded from a
 * real producer (librdkafka 2.0.2 against Apache Kafka, tests/fuzz/corpus/
 * kafka_stats/), brokers that are not real ones, the bound, hostile input,
 * and what the metrics show. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "encode.h"
#include "kafka_stats.h"
#include "metrics.h"

static void setup(void) {
        cr_assert_eq(metrics_init("outbox-relay"), 0);
}

static void teardown(void) {
        metrics_destroy();
}

TestSuite(kafka_stats, .init = setup, .fini = teardown, .timeout = 30);

/* A recorded statistics file; caller frees. */
static char *recorded(const char *name, size_t *len) {
        char path[512];
        snprintf(path, sizeof path, "%s/tests/fuzz/corpus/kafka_stats/%s", OUTBOX_SOURCE_DIR, name);
        FILE *f = fopen(path, "rb");
        cr_assert_not_null(f, "%s", path);
        char *data = malloc(1 << 20);
        cr_assert_not_null(data);
        *len = fread(data, 1, (1 << 20) - 1, f);
        data[*len] = '\0';
        fclose(f);
        return data;
}

static struct kafka_stats parse_ok(const char *json) {
        struct kafka_stats s;
        char err[256] = "";
        cr_assert_eq(kafka_stats_parse(json, strlen(json), &s, err, sizeof err), 0, "%s", err);
        return s;
}

Test(kafka_stats, recorded_producer_up) {
        size_t len;
        char *json = recorded("producer-up.json", &len);
        struct kafka_stats s;
        char err[256];
        cr_assert_eq(kafka_stats_parse(json, len, &s, err, sizeof err), 0, "%s", err);
        /* the bootstrap entry learned node id 1 (source "configured") */
        cr_assert_eq(s.nbrokers, 1);
        cr_expect_eq(s.brokers[0].id, 1);
        cr_expect_eq(s.brokers[0].up, 1);
        cr_expect_float_eq(s.brokers[0].rtt_p99_s, 0.153599, 1e-9);
        cr_expect_eq(s.brokers[0].inflight, 0);
        cr_expect_eq(s.brokers[0].outbuf, 0);
        cr_expect_eq(s.brokers_up, 1);
        cr_expect_eq(s.retries, 0);
        cr_expect_eq(s.errors, 0);
        cr_expect_eq(s.queue_messages, 0);
        free(json);
}

Test(kafka_stats, recorded_broker_down) {
        size_t len;
        char *json = recorded("producer-broker-down.json", &len);
        struct kafka_stats s;
        char err[256];
        cr_assert_eq(kafka_stats_parse(json, len, &s, err, sizeof err), 0, "%s", err);
        cr_assert_eq(s.nbrokers, 1);
        cr_expect_eq(s.brokers[0].up, 0, "state TRY_CONNECT");
        cr_expect_eq(s.brokers_up, 0);
        cr_expect_eq(s.errors, 1, "rxerrs 1");
        cr_expect_eq(s.queue_messages, 20, "20 messages produced after the broker went");
        free(json);
}

Test(kafka_stats, only_real_brokers_listed_every_entry_counted) {
        struct kafka_stats s = parse_ok(
                "{\"msg_cnt\": 7, \"brokers\": {"
                "\"b:9092/bootstrap\": {\"nodeid\": -1, \"source\": \"configured\", \"state\": "
                "\"DOWN\", \"txerrs\": 2, \"req_timeouts\": 1, \"txretries\": 5},"
                "\"GroupCoordinator\": {\"nodeid\": 3, \"source\": \"logical\", \"state\": "
                "\"UP\", \"rxerrs\": 1},"
                "\":0/internal\": {\"nodeid\": -1, \"source\": \"internal\", \"state\": \"UP\"},"
                "\"k3:9092/3\": {\"nodeid\": 3, \"source\": \"learned\", \"state\": \"UP\", "
                "\"waitresp_cnt\": 4, \"outbuf_msg_cnt\": 100, \"txretries\": 1, "
                "\"rtt\": {\"p99\": 2500}},"
                "\"k1:9092/1\": {\"nodeid\": 1, \"source\": \"learned\", \"state\": \"CONNECT\", "
                "\"rtt\": {\"p99\": 0}, \"txerrs\": 10, \"rxerrs\": 20, \"req_timeouts\": 30},"
                "\"k2:9092/2\": {\"nodeid\": 2, \"source\": \"learned\", \"state\": \"UP\"}}}");
        cr_assert_eq(s.nbrokers, 3);
        cr_expect_eq(s.brokers[0].id, 1, "ordered by node id");
        cr_expect_eq(s.brokers[1].id, 2);
        cr_expect_eq(s.brokers[2].id, 3);
        cr_expect_eq(s.brokers[0].up, 0);
        cr_expect_eq(s.brokers[2].up, 1);
        cr_expect_float_eq(s.brokers[2].rtt_p99_s, 0.0025, 1e-12);
        cr_expect_eq(s.brokers[2].inflight, 4);
        cr_expect_eq(s.brokers[2].outbuf, 100);
        cr_expect_eq(s.brokers_up, 2);
        cr_expect_eq(s.retries, 6, "bootstrap entries' retries count too");
        cr_expect_eq(s.errors, 2 + 1 + 1 + 10 + 20 + 30);
        cr_expect_eq(s.queue_messages, 7);
}

Test(kafka_stats, one_broker_under_two_names_merged) {
        struct kafka_stats s = parse_ok(
                "{\"brokers\": {"
                "\"a/1\": {\"nodeid\": 1, \"source\": \"configured\", \"state\": \"DOWN\", "
                "\"waitresp_cnt\": 1, \"rtt\": {\"p99\": 1000}},"
                "\"b/1\": {\"nodeid\": 1, \"source\": \"learned\", \"state\": \"UP\", "
                "\"waitresp_cnt\": 2, \"rtt\": {\"p99\": 3000}}}}");
        cr_assert_eq(s.nbrokers, 1);
        cr_expect_eq(s.brokers[0].up, 1);
        cr_expect_eq(s.brokers[0].inflight, 3);
        cr_expect_float_eq(s.brokers[0].rtt_p99_s, 0.003, 1e-12);
        cr_expect_eq(s.brokers_up, 1);
}

Test(kafka_stats, at_most_64_brokers) {
        struct buf b = {0};
        cr_assert_eq(buf_appendf(&b, "{\"brokers\": {"), 0);
        for (int i = 0; i < 100; i++)
                cr_assert_eq(buf_appendf(&b,
                                         "%s\"k%d/%d\": {\"nodeid\": %d, \"state\": \"UP\", "
                                         "\"txretries\": 1}",
                                         i ? "," : "", i, i, 1000 - i),
                             0);
        cr_assert_eq(buf_appendf(&b, "}}"), 0);
        struct kafka_stats s = parse_ok(b.data);
        cr_expect_eq(s.nbrokers, KAFKA_STATS_MAX_BROKERS);
        cr_expect_eq(s.brokers_up, 100, "every broker counts as up");
        cr_expect_eq(s.retries, 100, "and in the totals");
        for (size_t i = 1; i < s.nbrokers; i++)
                cr_expect_lt(s.brokers[i - 1].id, s.brokers[i].id);
        buf_free(&b);
}

Test(kafka_stats, hostile_input_refused) {
        static const char *const bad[] = {
                "",
                "   ",
                "[]",
                "\"brokers\"",
                "42",
                "null",
                "{\"brokers\": {",
                "{\"brokers\": {}} trailing",
                "{\"brokers\": {\"a\": {\"nodeid\": 99999999999999999999999}}}",
                "{\"a\": \"\\ud800\"}",
        };
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
                struct kafka_stats s;
                char err[64] = "";
                cr_expect_eq(kafka_stats_parse(bad[i], strlen(bad[i]), &s, err, sizeof err), -1,
                             "accepted: %s", bad[i]);
                cr_expect_neq(err[0], '\0');
                cr_expect_eq(s.nbrokers, 0);
        }
        /* deeper than jansson's nesting limit */
        struct buf b = {0};
        for (int i = 0; i < 5000; i++)
                cr_assert_eq(buf_append(&b, "[", 1), 0);
        struct kafka_stats s;
        char err[64];
        cr_expect_eq(kafka_stats_parse(b.data, b.len, &s, err, sizeof err), -1);
        buf_free(&b);
        /* the length is honoured: no NUL needed, none read past */
        const char json[] = {'{', '}', '!'};
        cr_expect_eq(kafka_stats_parse(json, 2, &s, err, sizeof err), 0);
        cr_expect_eq(kafka_stats_parse(json, 3, &s, err, sizeof err), -1);
}

Test(kafka_stats, odd_values_read_zero) {
        struct kafka_stats s = parse_ok(
                "{\"msg_cnt\": -5, \"brokers\": {"
                "\"x\": 1, \"y\": [], \"z\": null,"
                "\"a/1\": {\"nodeid\": 1, \"state\": 7, \"waitresp_cnt\": \"9\", "
                "\"outbuf_msg_cnt\": -3, \"txretries\": 1e300, \"txerrs\": 9223372036854775807, "
                "\"rxerrs\": 9223372036854775807, \"rtt\": {\"p99\": -1}},"
                "\"b/2\": {\"nodeid\": 2.5, \"state\": \"UP\"},"
                "\"c/3\": {\"nodeid\": 3000000000, \"state\": \"UP\"},"
                "\"d/4\": {\"nodeid\": \"4\", \"state\": \"UP\"}}}");
        cr_assert_eq(s.nbrokers, 1);
        cr_expect_eq(s.brokers[0].up, 0);
        cr_expect_eq(s.brokers[0].inflight, 0);
        cr_expect_eq(s.brokers[0].outbuf, 0);
        cr_expect_eq(s.brokers[0].rtt_p99_s, 0);
        cr_expect_eq(s.retries, 9223372036854775807LL, "saturates");
        cr_expect_eq(s.errors, 9223372036854775807LL, "saturates");
        cr_expect_eq(s.queue_messages, 0);
        s = parse_ok("{}");
        cr_expect_eq(s.nbrokers, 0);
        s = parse_ok("{\"brokers\": []}");
        cr_expect_eq(s.nbrokers, 0);
}

/* The rendered exposition; caller frees. */
static char *render(void) {
        struct buf b = {0};
        cr_assert_eq(metrics_render(&b), 0);
        return b.data;
}

static double sample(const char *text, const char *series) {
        size_t n = strlen(series);
        for (const char *p = text; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL)
                if (strncmp(p, series, n) == 0 && p[n] == ' ')
                        return strtod(p + n + 1, NULL);
        return NAN;
}

Test(kafka_stats, apply_exports) {
        struct kafka_stats_seen seen = {0};
        struct kafka_stats s =
                parse_ok("{\"msg_cnt\": 12, \"brokers\": {"
                         "\"k1/1\": {\"nodeid\": 1, \"state\": \"UP\", \"waitresp_cnt\": 2, "
                         "\"outbuf_msg_cnt\": 30, \"rtt\": {\"p99\": 4000}, \"txretries\": 3, "
                         "\"txerrs\": 1},"
                         "\"k2/2\": {\"nodeid\": 2, \"state\": \"DOWN\", \"req_timeouts\": 2}}}");
        cr_assert_eq(kafka_stats_apply(&s, &seen), 0);
        char *text = render();
        cr_expect_eq(sample(text, "outbox_kafka_brokers_up"), 1);
        cr_expect_eq(sample(text, "outbox_kafka_queue_messages"), 12);
        cr_expect_eq(sample(text, "outbox_kafka_broker_rtt_p99_seconds{broker=\"1\"}"), 0.004);
        cr_expect_eq(sample(text, "outbox_kafka_broker_rtt_p99_seconds{broker=\"2\"}"), 0);
        cr_expect_eq(sample(text, "outbox_kafka_broker_inflight_requests{broker=\"1\"}"), 2);
        cr_expect_eq(sample(text, "outbox_kafka_broker_outbuf_messages{broker=\"1\"}"), 30);
        cr_expect_eq(sample(text, "outbox_kafka_retries_total"), 3, "equals librdkafka's total");
        cr_expect_eq(sample(text, "outbox_kafka_errors_total"), 3);
        free(text);

        /* later: broker 2 left, totals grew */
        s = parse_ok("{\"msg_cnt\": 0, \"brokers\": {"
                     "\"k1/1\": {\"nodeid\": 1, \"state\": \"UP\", \"txretries\": 10, "
                     "\"txerrs\": 2}}}");
        cr_assert_eq(kafka_stats_apply(&s, &seen), 0);
        text = render();
        cr_expect(isnan(sample(text, "outbox_kafka_broker_rtt_p99_seconds{broker=\"2\"}")));
        cr_expect_eq(sample(text, "outbox_kafka_retries_total"), 10);
        cr_expect_eq(sample(text, "outbox_kafka_errors_total"), 3,
                     "broker 2's 2 gone: 2 < 3 adds nothing");
        free(text);

        /* a new producer starts from zero: the counters keep their values, then grow */
        s = parse_ok("{\"brokers\": {\"k1/1\": {\"nodeid\": 1, \"txretries\": 1}}}");
        cr_assert_eq(kafka_stats_apply(&s, &seen), 0);
        s = parse_ok("{\"brokers\": {\"k1/1\": {\"nodeid\": 1, \"txretries\": 4, "
                     "\"txerrs\": 2}}}");
        cr_assert_eq(kafka_stats_apply(&s, &seen), 0);
        text = render();
        cr_expect_eq(sample(text, "outbox_kafka_retries_total"), 13);
        cr_expect_eq(sample(text, "outbox_kafka_errors_total"), 5);
        cr_expect_eq(sample(text, "outbox_kafka_brokers_up"), 0);
        free(text);
}
