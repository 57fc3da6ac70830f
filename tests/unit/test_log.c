/* test_log.c - log lines in both formats: every value escaped, keys only from
 * the code, one line per call whatever the arguments hold, long values cut
 * without losing the fields after them. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "log.h"
#include "log_parse.h"

static char line[LOG_LINE_MAX];
static struct log_parsed lp;

/* Parses `line` (n bytes) and checks its keys are exactly ts, level, mod, msg
 * and then `keys` (NULL-terminated). */
static void expect_keys(size_t n, int json, const char *const *keys) {
        cr_assert_eq(log_parse_line(line, n, json, &lp), 0, "not one well-formed line: %s", line);
        const char *head[] = {"ts", "level", "mod", "msg"};
        size_t want = 4;
        for (const char *const *k = keys; *k; k++)
                want++;
        cr_assert_eq(lp.n, want, "%zu fields in: %s", lp.n, line);
        for (size_t i = 0; i < 4; i++)
                cr_assert_str_eq(lp.key[i], head[i], "%s", line);
        for (size_t i = 4; i < want; i++)
                cr_assert_str_eq(lp.key[i], keys[i - 4], "%s", line);
}

static const char *value_of(const char *key) {
        int i = log_parsed_find(&lp, key);
        cr_assert_geq(i, 0, "no %s in %s", key, line);
        return lp.value[i];
}

Test(log, text_values_bare_or_quoted) {
        size_t n = log_format(line, sizeof line, 0, LOG_INFO, "relay", "event dead",
                              "topic=%s rows=%zu empty=%s", "orders", (size_t)5, "");
        expect_keys(n, 0, (const char *[]){"topic", "rows", "empty", NULL});
        cr_expect_not_null(strstr(line, " level=info mod=relay msg=\"event dead\" topic=orders "
                                        "rows=5 empty=\"\"\n"),
                           "%s", line);
}

Test(log, json_values_are_strings) {
        size_t n = log_format(line, sizeof line, 1, LOG_WARN, "db", "lock batch failed",
                              "err=%s retry_ms=%d", "boom \"x\"", 200);
        expect_keys(n, 1, (const char *[]){"err", "retry_ms", NULL});
        cr_expect_not_null(strstr(line,
                                  "\"level\":\"warn\",\"mod\":\"db\",\"msg\":\"lock batch "
                                  "failed\",\"err\":\"boom \\\"x\\\"\",\"retry_ms\":\"200\"}\n"),
                           "%s", line);
}

/* An aggregate_type that looks like more fields, or a whole second line. */
Test(log, row_data_cannot_add_fields_or_lines) {
        const char *forged[] = {
                "Has Space level=error err=FORGED",
                "x\nts=2024-01-01T00:00:00.000Z level=error mod=relay msg=\"forged\"",
                "x\"} {\"level\":\"error\",\"forged\":\"1",
                "x\r\n{\"ts\":\"t\",\"level\":\"error\"}",
                "a\xe2\x80\xa8"
                "b\xc2\x85"
                "c\x0b\x0c\x1c\x1d\x1e\x7f"
                "d",
                "\\\"\\\\\" err=FORGED",
        };
        for (int json = 0; json <= 1; json++) {
                for (size_t i = 0; i < sizeof forged / sizeof forged[0]; i++) {
                        size_t n =
                                log_format(line, sizeof line, json, LOG_WARN, "relay", "event dead",
                                           "outbox_id=%s topic=%s err=%s reason=%s", "id-1",
                                           forged[i], "INVALID_TOPIC", forged[i]);
                        expect_keys(n, json,
                                    (const char *[]){"outbox_id", "topic", "err", "reason", NULL});
                        cr_expect_str_eq(value_of("topic"), forged[i]);
                        cr_expect_str_eq(value_of("err"), "INVALID_TOPIC");
                        cr_expect_str_eq(value_of("reason"), forged[i]);
                }
        }
}

Test(log, control_characters_and_separators_escaped) {
        size_t n = log_format(line, sizeof line, 1, LOG_INFO, "m", "x", "v=%s",
                              "\x01\t\n\r\x1f\x7f\xc2\x85\xe2\x80\xa8\xe2\x80\xa9\xc3\xa9");
        cr_assert_gt(n, 0);
        cr_expect_not_null(strstr(line, "\"v\":\"\\u0001\\t\\n\\r\\u001f\\u007f\\u0085\\u2028"
                                        "\\u2029\xc3\xa9\"}\n"),
                           "%s", line);
        n = log_format(line, sizeof line, 0, LOG_INFO, "m", "x", "v=%s",
                       "a\x01"
                       "b");
        cr_expect_not_null(strstr(line, " v=\"a\\u0001b\"\n"), "%s", line);
}

Test(log, invalid_utf8_replaced) {
        for (int json = 0; json <= 1; json++) {
                size_t n = log_format(line, sizeof line, json, LOG_INFO, "m", "x", "v=%s w=%s",
                                      "a\xff\xc3(\xed\xa0\x80z", "\xf0\x9f\x98\x80");
                expect_keys(n, json, (const char *[]){"v", "w", NULL});
                cr_expect_str_eq(value_of("v"), "a\xef\xbf\xbd\xef\xbf\xbd("
                                                "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbdz");
                cr_expect_str_eq(value_of("w"), "\xf0\x9f\x98\x80");
        }
}

/* A 5000-byte topic is cut, and err and reason after it are still there. */
Test(log, long_value_cut_keeps_later_fields) {
        char topic[5001];
        memset(topic, 't', 5000);
        topic[5000] = '\0';
        for (int json = 0; json <= 1; json++) {
                size_t n = log_format(line, sizeof line, json, LOG_WARN, "relay", "event dead",
                                      "outbox_id=%s topic=%s err=%s reason=%s", "id-1", topic,
                                      "INVALID_TOPIC", "too long");
                expect_keys(n, json, (const char *[]){"outbox_id", "topic", "err", "reason", NULL});
                const char *t = value_of("topic");
                cr_expect_eq(strlen(t), LOG_VALUE_MAX);
                cr_expect_str_eq(t + LOG_VALUE_MAX - 3, "...");
                cr_expect_str_eq(value_of("err"), "INVALID_TOPIC");
                cr_expect_str_eq(value_of("reason"), "too long");
        }
        /* escaped text counts: 1000 control characters are 6000 bytes escaped */
        char ctl[1001];
        memset(ctl, '\x01', 1000);
        ctl[1000] = '\0';
        size_t n = log_format(line, sizeof line, 1, LOG_INFO, "m", "x", "a=%s b=%d", ctl, 7);
        expect_keys(n, 1, (const char *[]){"a", "b", NULL});
        cr_expect_str_eq(value_of("b"), "7");
        /* cut inside a character: never half a character */
        char utf[LOG_VALUE_MAX + 8];
        memset(utf, 'a', LOG_VALUE_MAX - 1);
        strcpy(utf + LOG_VALUE_MAX - 1, "\xc3\xa9\xc3\xa9");
        n = log_format(line, sizeof line, 0, LOG_INFO, "m", "x", "a=%s", utf);
        expect_keys(n, 0, (const char *[]){"a", NULL});
        /* mod and msg are cut too */
        n = log_format(line, sizeof line, 1, LOG_INFO, topic, topic, "a=%d", 1);
        expect_keys(n, 1, (const char *[]){"a", NULL});
}

Test(log, keys_come_from_the_format_only) {
        size_t n = log_format(line, sizeof line, 0, LOG_INFO, "m", "x",
                              "we\"ird=%s %s lit=a%sb pct=%d%% =%s", "1", "2=3 x=y", "4", 50, "6");
        expect_keys(n, 0, (const char *[]){"we_ird", "_", "lit", "pct", "_", NULL});
        cr_expect_str_eq(lp.value[5], "2=3 x=y");
        cr_expect_str_eq(value_of("lit"), "a4b");
        cr_expect_str_eq(value_of("pct"), "50%");
        cr_expect_str_eq(lp.value[8], "6");
}

Test(log, conversions_as_printf) {
        char want[256];
        size_t n = log_format(line, sizeof line, 1, LOG_INFO, "m", "x",
                              "a=%d b=%zu c=%lld d=%.3f e=%016llx f=%5s g=%-3s| h=%c i=%*d j=%.*s "
                              "k=%u l=%ld m=%hhd n=%g",
                              -5, (size_t)42, -1234567890123LL, 0.5, 0xabcULL, "ab", "c", 'z', 4, 7,
                              2, "xyz", 3u, -9L, (signed char)-3, 1e300);
        cr_assert_gt(n, 0);
        cr_assert_eq(log_parse_line(line, n, 1, &lp), 0, "%s", line);
        snprintf(want, sizeof want, "%016llx", 0xabcULL);
        cr_expect_str_eq(value_of("a"), "-5");
        cr_expect_str_eq(value_of("b"), "42");
        cr_expect_str_eq(value_of("c"), "-1234567890123");
        cr_expect_str_eq(value_of("d"), "0.500");
        cr_expect_str_eq(value_of("e"), want);
        cr_expect_str_eq(value_of("f"), "   ab");
        cr_expect_str_eq(value_of("g"), "c  |");
        cr_expect_str_eq(value_of("h"), "z");
        cr_expect_str_eq(value_of("i"), "   7");
        cr_expect_str_eq(value_of("j"), "xy");
        cr_expect_str_eq(value_of("k"), "3");
        cr_expect_str_eq(value_of("l"), "-9");
        cr_expect_str_eq(value_of("m"), "-3");
        cr_expect_str_eq(value_of("n"), "1e+300");
}

Test(log, null_fields_and_small_buffers) {
        size_t n = log_format(line, sizeof line, 0, LOG_ERROR, "m", "stopped", NULL);
        expect_keys(n, 0, (const char *[]){NULL});
        char small[80];
        n = log_format(small, sizeof small, 1, LOG_INFO, "m", "x", "a=%s b=%s", "1",
                       "a value that does not fit in eighty bytes with the head of the line");
        cr_assert_eq(log_parse_line(small, n, 1, &lp), 0, "%s", small);
        cr_expect_eq(lp.n, 5, "the field that does not fit is left out whole: %s", small);
        cr_expect_eq(log_format(small, 2, 1, LOG_INFO, "m", "x", NULL), 0);
}

/* Arbitrary bytes in mod, msg and every value: one line, the code's keys,
 * and the values read back as written (valid UTF-8 under the cut). */
Test(log, arbitrary_bytes_property) {
        unsigned seed = 16;
        static char v[4][1500];
        for (int iter = 0; iter < 3000; iter++) {
                for (int j = 0; j < 4; j++) {
                        size_t len = (size_t)(rand_r(&seed) % (iter % 10 == 0 ? 1400 : 40));
                        for (size_t k = 0; k < len; k++) {
                                int r = rand_r(&seed) % 8;
                                /* bias towards the bytes that matter */
                                v[j][k] = r == 0   ? "\n\r\t\" =\\{}"[rand_r(&seed) % 10]
                                          : r == 1 ? (char)(0x80 + rand_r(&seed) % 0x80)
                                                   : (char)(1 + rand_r(&seed) % 255);
                        }
                        v[j][len] = '\0';
                }
                int json = iter & 1;
                size_t n = log_format(line, sizeof line, json, LOG_WARN, v[0], v[1],
                                      "topic=%s err=%s n=%d reason=%s", v[2], v[3], iter, v[2]);
                expect_keys(n, json, (const char *[]){"topic", "err", "n", "reason", NULL});
                for (int j = 2; j <= 3; j++) {
                        size_t len = strlen(v[j]), k;
                        for (k = 0; k < len && lp_utf8((unsigned char *)v[j] + k, len - k);)
                                k += lp_utf8((unsigned char *)v[j] + k, len - k);
                        if (k == len && len <= LOG_VALUE_MAX / 6)
                                cr_expect_str_eq(value_of(j == 2 ? "topic" : "err"), v[j]);
                }
        }
}

/* log_write: the threshold, and one line on stderr per call. */
Test(log, write_goes_to_stderr_above_the_threshold) {
        FILE *tmp = tmpfile();
        cr_assert_not_null(tmp);
        int saved = dup(2);
        cr_assert_geq(saved, 0);
        fflush(stderr);
        cr_assert_geq(dup2(fileno(tmp), 2), 0);
        log_setup(LOG_INFO, 0);
        log_debug("m", "hidden", "a=%d", 1);
        log_info("m", "shown", "a=%s", "x\ny");
        log_setup(LOG_WARN, 1);
        log_info("m", "hidden", NULL);
        log_error("m", "shown", "b=%d", 2);
        fflush(stderr);
        cr_assert_geq(dup2(saved, 2), 0);
        close(saved);
        rewind(tmp);
        char buf[1024];
        size_t n = fread(buf, 1, sizeof buf - 1, tmp);
        fclose(tmp);
        buf[n] = '\0';
        cr_expect_null(strstr(buf, "hidden"), "%s", buf);
        char *nl = strchr(buf, '\n');
        cr_assert_not_null(nl);
        cr_expect_eq(log_parse_line(buf, (size_t)(nl + 1 - buf), 0, &lp), 0, "%s", buf);
        cr_expect_str_eq(lp.value[4], "x\ny");
        cr_expect_eq(log_parse_line(nl + 1, strlen(nl + 1), 1, &lp), 0, "%s", nl + 1);
        cr_expect_str_eq(lp.value[1], "error");
}
