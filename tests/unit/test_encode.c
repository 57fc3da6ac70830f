/* Unit tests of encode: topic template, JSON envelope, headers. */
#include <criterion/criterion.h>
#include <stdint.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "encode.h"
#include "sample_event.h"

static struct outbox_event sample(void) {
        return sample_event();
}

static struct buf b;
static void fini(void) {
        buf_free(&b);
}
TestSuite(encode, .fini = fini);

Test(encode, topic_template_placeholders) {
        static const char *const cases[][2] = {
                {"outbox.event.{aggregate_type}", "outbox.event.Order"},
                {"{tenant_id}.{aggregate_type}.{event_type}.{x}", "acme.Order.OrderCreated.{x}"},
                /* edges: a placeholder alone, braces around one, an unclosed one */
                {"{aggregate_type}", "Order"},
                {"{{aggregate_type}}{", "{Order}{"},
                {"x{tenant_id", "x{tenant_id"},
        };
        struct outbox_event ev = sample();
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
                cr_assert_eq(encode_topic(cases[i][0], &ev, &b), 0, "%s", cases[i][0]);
                cr_assert_str_eq(b.data, cases[i][1]);
        }
        ev.topic_name = "explicit";
        cr_assert_eq(encode_topic("outbox.event.{aggregate_type}", &ev, &b), 0);
        cr_assert_str_eq(b.data, "explicit");
}

Test(encode, decimal_numbers) {
        const long long v[] = {0, 7, -1, 1234567890123LL, LLONG_MAX, LLONG_MIN};
        char want[32];
        for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) {
                buf_reset(&b);
                cr_assert_eq(buf_append_ll(&b, v[i]), 0);
                snprintf(want, sizeof want, "%lld", v[i]);
                cr_assert_str_eq(b.data, want);
        }
}

Test(encode, envelope_has_every_key_and_nulls) {
        struct outbox_event ev = sample();
        cr_assert_eq(encode_envelope_json(&ev, &b), 0);
        cr_assert_str_eq(b.data,
                         "{\"event_id\":\"0b8f3f2e-8a57-4c39-9a0e-3c1d2a0f6b11\",\"event_type\":"
                         "\"OrderCreated\","
                         "\"event_version\":2,\"tenant_id\":\"acme\",\"aggregate_type\":\"Order\","
                         "\"aggregate_id\":\"o-1\",\"aggregate_version\":7,"
                         "\"occurred_at\":\"2026-11-23T00:00:00.000001Z\",\"correlation_id\":null,"
                         "\"causation_id\":null,\"trace_id\":null,\"payload\":{\"total\": 12.5}}");
}

Test(encode, envelope_escapes_strings_and_null_payload) {
        struct outbox_event ev = sample();
        ev.aggregate_id = "a\"b\\c\n\x01";
        ev.payload = NULL;
        ev.trace_id = "t";
        cr_assert_eq(encode_envelope_json(&ev, &b), 0);
        cr_assert(strstr(b.data, "\"aggregate_id\":\"a\\\"b\\\\c\\n\\u0001\""), "%s", b.data);
        cr_assert(strstr(b.data, "\"trace_id\":\"t\""));
        cr_assert(strstr(b.data, "\"payload\":null}"));
}

static const char *find(const struct encode_header *h, int n, const char *name, size_t *len) {
        for (int i = 0; i < n; i++)
                if (!strcmp(h[i].name, name)) {
                        *len = h[i].value_len;
                        return h[i].value;
                }
        return NULL;
}

Test(encode, fixed_headers_then_members_that_do_not_clash) {
        struct outbox_event ev = sample();
        struct encode_header h[ENCODE_MAX_HEADERS];
        char err[128];
        size_t len = 0;
        ev.correlation_id = "c-1";
        /* members: event-id (must not replace), x-a = "1", x-json = {"k":1} */
        ev.headers = "8:event-id4:evil3:x-a1:16:x-json7:{\"k\":1}";
        int n = encode_headers(&ev, "outbox-relay", "application/json", NULL, h, &b, err,
                               sizeof err);
        cr_assert_eq(n, 13, "n=%d err=%s", n, err);
        const char *names[] = {"event-id",       "event-type",   "event-version",     "tenant-id",
                               "aggregate-type", "aggregate-id", "aggregate-version", "occurred-at",
                               "producer",       "content-type", "correlation-id"};
        for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
                cr_assert_str_eq(h[i].name, names[i]);
        cr_assert_eq(strncmp(find(h, n, "event-id", &len), ev.outbox_id, len), 0);
        cr_assert_eq(strncmp(find(h, n, "aggregate-version", &len), "7", len), 0);
        cr_assert_eq(strncmp(find(h, n, "event-version", &len), "2", len), 0);
        cr_assert_null(find(h, n, "trace-id", &len));
        cr_assert_null(find(h, n, "event-key", &len));
        const char *v = find(h, n, "x-json", &len);
        cr_assert_eq(len, 7);
        cr_assert_eq(strncmp(v, "{\"k\":1}", 7), 0);
        v = find(h, n, "x-a", &len);
        cr_assert_eq(len, 1);
        cr_assert_eq(*v, '1');
}

Test(encode, headers_not_an_object_or_malformed) {
        struct outbox_event ev = sample();
        struct encode_header h[ENCODE_MAX_HEADERS];
        char err[128];
        ev.headers = NULL;
        cr_assert_eq(encode_headers(&ev, "p", "application/json", NULL, h, &b, err, sizeof err),
                     -1);
        cr_assert(strstr(err, "not a JSON object"));
        ev.headers = "5:ab";
        cr_assert_eq(encode_headers(&ev, "p", "application/json", NULL, h, &b, err, sizeof err),
                     -1);
        ev.headers = "99999999999999999999:x";
        cr_assert_eq(encode_headers(&ev, "p", "application/json", NULL, h, &b, err, sizeof err),
                     -1);
}

/* headers_json of n members named m0, m1, ... with value "v". */
static const char *members(int n, struct buf *out) {
        buf_reset(out);
        for (int i = 0; i < n; i++) {
                char name[16];
                int nl = snprintf(name, sizeof name, "m%d", i);
                cr_assert_eq(buf_appendf(out, "%d:%s1:v", nl, name), 0);
        }
        return out->data ? out->data : "";
}

/* One limit, whatever the row holds: ENCODE_MAX_HEADER_MEMBERS members pass
 * with every optional fixed header present or none, one more is refused by
 * a message that names the limit. */
Test(encode, headers_json_member_limit) {
        struct buf hj = {0};
        struct encode_header h[ENCODE_MAX_HEADERS];
        char err[128], want[64];
        for (int optional = 0; optional <= 1; optional++) {
                struct outbox_event ev = sample();
                if (!optional)
                        ev.correlation_id = ev.causation_id = ev.trace_id = ev.event_key = NULL;
                else
                        ev.correlation_id = ev.causation_id = ev.trace_id = ev.event_key = "x";
                ev.headers = members(ENCODE_MAX_HEADER_MEMBERS, &hj);
                int n = encode_headers(&ev, "p", "application/json", optional ? "7" : NULL, h, &b,
                                       err, sizeof err);
                cr_expect_gt(n, ENCODE_MAX_HEADER_MEMBERS, "%s", err);
                ev.headers = members(ENCODE_MAX_HEADER_MEMBERS + 1, &hj);
                cr_expect_eq(encode_headers(&ev, "p", "application/json", optional ? "7" : NULL, h,
                                            &b, err, sizeof err),
                             -1);
                snprintf(want, sizeof want, "more than %d members", ENCODE_MAX_HEADER_MEMBERS);
                cr_expect_not_null(strstr(err, want), "%s", err);
        }
        buf_free(&hj);
}

Test(encode, buf_grows) {
        for (int i = 0; i < 10000; i++)
                cr_assert_eq(buf_appendf(&b, "%d,", i % 10), 0);
        cr_assert_eq(b.len, 20000);
        buf_reset(&b);
        cr_assert_eq(b.len, 0);
        cr_assert_str_eq(b.data, "");
}

Test(encode, utf8_clean) {
        struct {
                const char *in, *out;
        } c[] = {
                {"plain ascii", "plain ascii"},
                {"caf\xc3\xa9", "caf\xc3\xa9"},
                {"cut \xc3", "cut "},     /* 2-byte character cut at the end */
                {"cut \xe2\x82", "cut "}, /* 3-byte character cut at the end */
                {"bad \xff byte", "bad ? byte"},
                {"lone \x80 cont", "lone ? cont"},
                {"overlong \xc0\xaf", "overlong ??"},
                {"surrogate \xed\xa0\x80", "surrogate ???"},
                {"euro \xe2\x82\xac ok", "euro \xe2\x82\xac ok"},
                {"emoji \xf0\x9f\x98\x80", "emoji \xf0\x9f\x98\x80"},
        };
        for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
                char s[64];
                snprintf(s, sizeof s, "%s", c[i].in);
                encode_utf8_clean(s);
                cr_expect_str_eq(s, c[i].out, "case %zu", i);
        }
}

/* microseconds since 2000-01-01 of a UTC date and time */
static long long us_of(long long days_since_2000, long long secs, long long us) {
        return (days_since_2000 * 86400 + secs) * 1000000 + us;
}

Test(encode, rfc3339_of_a_timestamptz) {
        char out[40];
        cr_assert_eq(encode_rfc3339_us(0, out, sizeof out), 0);
        cr_expect_str_eq(out, "2000-01-01T00:00:00.000000Z");
        cr_assert_eq(encode_rfc3339_us(us_of(8887, 36000, 123456), out, sizeof out), 0);
        cr_expect_str_eq(out, "2024-05-01T10:00:00.123456Z");
        /* before 2000: negative, rounded towards the earlier second */
        cr_assert_eq(encode_rfc3339_us(-1, out, sizeof out), 0);
        cr_expect_str_eq(out, "1999-12-31T23:59:59.999999Z");
        /* the first and the last instants RFC 3339 can write */
        cr_assert_eq(encode_rfc3339_us(us_of(-730119, 0, 0), out, sizeof out), 0);
        cr_expect_str_eq(out, "0001-01-01T00:00:00.000000Z");
        cr_assert_eq(encode_rfc3339_us(us_of(2921939, 86399, 999999), out, sizeof out), 0);
        cr_expect_str_eq(out, "9999-12-31T23:59:59.999999Z");
}

Test(encode, rfc3339_refuses_what_it_cannot_write) {
        char out[40] = "x";
        /* 'infinity', '-infinity', 1 BC, year 10000 */
        cr_expect_eq(encode_rfc3339_us(INT64_MAX, out, sizeof out), -1);
        cr_expect_str_eq(out, "");
        cr_expect_eq(encode_rfc3339_us(INT64_MIN, out, sizeof out), -1);
        cr_expect_eq(encode_rfc3339_us(us_of(-730119, 0, 0) - 1, out, sizeof out), -1);
        cr_expect_eq(encode_rfc3339_us(us_of(2921940, 0, 0), out, sizeof out), -1);
        /* PostgreSQL's own extremes (4713 BC, 294276 AD) */
        cr_expect_eq(encode_rfc3339_us(-211813488000000000LL, out, sizeof out), -1);
        cr_expect_eq(encode_rfc3339_us(9223371331200000000LL, out, sizeof out), -1);
}

Test(encode, utf8_prefix_cuts_on_a_character_boundary) {
        /* "é" is 2 bytes, "€" 3, "😀" 4 */
        struct {
                const char *s;
                size_t max, want;
        } c[] = {
                {"short", 63, 5},
                {"abcdef", 3, 3},
                {"abcdef", 0, 0},
                {"a\xc3\xa9", 2, 1},                /* would split é */
                {"a\xc3\xa9", 3, 3},                /* ends right after é */
                {"\xe2\x82\xac\xe2\x82\xac", 4, 3}, /* inside the second € */
                {"\xe2\x82\xac\xe2\x82\xac", 5, 3},
                {"\xe2\x82\xac\xe2\x82\xac", 6, 6},
                {"x\xf0\x9f\x98\x80y", 4, 1}, /* inside the emoji */
                {"x\xf0\x9f\x98\x80y", 5, 5},
        };
        for (size_t i = 0; i < sizeof c / sizeof c[0]; i++)
                cr_expect_eq(encode_utf8_prefix(c[i].s, c[i].max), c[i].want, "case %zu: %zu", i,
                             encode_utf8_prefix(c[i].s, c[i].max));
        /* the NOTIFY channel of a 63-byte table name "x" + 31 x "é" in
         * schema "t_0123abcd": byte 63 falls inside an é, so 62 bytes remain */
        char channel[200] = "t_0123abcd.x";
        for (int i = 0; i < 31; i++)
                strcat(channel, "\xc3\xa9");
        cr_assert_eq(strlen(channel), 74);
        cr_assert_eq(encode_utf8_prefix(channel, 63), 62);
        /* a 52-byte schema of "é" and the table outbox_event: the cut falls in
         * the ASCII table name, at 63 bytes (the trigger used to cut 63
         * characters, 65 bytes, which PostgreSQL refuses) */
        char wide[200] = "";
        for (int i = 0; i < 26; i++)
                strcat(wide, "\xc3\xa9");
        strcat(wide, ".outbox_event");
        cr_assert_eq(encode_utf8_prefix(wide, 63), 63);
}

Test(encode, utf8_printable) {
        const char *good[] = {"",
                              "relay-1",
                              "pod_7.zone-a",
                              "caf\xc3\xa9",
                              "\xe2\x82\xac",
                              "\xf0\x9f\x98\x80",
                              "with space"};
        const char *bad[] = {"new\nline",
                             "tab\t",
                             "bell\x07",
                             "del\x7f",
                             "c1 \xc2\x85",
                             "cut \xc3",
                             "bad \xff",
                             "overlong \xc0\xaf",
                             "surrogate \xed\xa0\x80",
                             "past \xf4\x90\x80\x80"};
        for (size_t i = 0; i < sizeof good / sizeof good[0]; i++)
                cr_expect(encode_utf8_printable(good[i]), "%s", good[i]);
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
                cr_expect(!encode_utf8_printable(bad[i]), "case %zu", i);
}

Test(encode, topic_is_legal) {
        char longest[ENCODE_TOPIC_MAX + 2];
        memset(longest, 'a', sizeof longest);
        longest[ENCODE_TOPIC_MAX] = '\0';
        const char *good[] = {"orders", "outbox.event.Order", "a-b_c.D9", "...", "_", longest};
        for (size_t i = 0; i < sizeof good / sizeof good[0]; i++)
                cr_expect(encode_topic_is_legal(good[i]), "%s", good[i]);
        longest[ENCODE_TOPIC_MAX] = 'a';
        longest[ENCODE_TOPIC_MAX + 1] = '\0';
        const char *bad[] = {"",    ".",   "..",        "with space", "slash/es", "caf\xc3\xa9",
                             "a:b", "{x}", "new\nline", longest};
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
                cr_expect(!encode_topic_is_legal(bad[i]), "case %zu", i);
}

Test(encode, topic_column_names_the_culprit) {
        struct outbox_event ev = sample();
        cr_expect_str_eq(encode_topic_column("x.{aggregate_type}", &ev), "aggregate_type");
        ev.event_type = "Order Created";
        cr_expect_str_eq(encode_topic_column("{aggregate_type}.{event_type}", &ev), "event_type");
        ev.event_type = "OrderCreated";
        ev.tenant_id = "t/1";
        cr_expect_str_eq(encode_topic_column("{aggregate_type}.{tenant_id}", &ev), "tenant_id");
        /* only too long: the longest value */
        char big[300];
        memset(big, 'x', sizeof big - 1);
        big[sizeof big - 1] = '\0';
        ev.tenant_id = "acme";
        ev.aggregate_id = "o-1";
        ev.event_type = big;
        cr_expect_str_eq(encode_topic_column("{aggregate_type}.{event_type}", &ev), "event_type");
        ev.topic_name = "bad topic";
        cr_expect_str_eq(encode_topic_column("{aggregate_type}", &ev), "topic_name");
}
