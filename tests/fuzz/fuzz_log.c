/* fuzz_log.c - the log writer: arbitrary bytes as mod, msg and values, the
 * code's kinds of formats and formats made from the input (literal text,
 * keys of any bytes, %s and %%). Every line must read back as one
 * well-formed record (log_parse.h) with one field per format token. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "log_parse.h"

#define PARTS 8

static char line[LOG_LINE_MAX];
static struct log_parsed lp;

/* Splits data at each 0xFF byte into NUL-terminated parts (the bytes 0x00
 * inside a part end its string early, as in C). */
static size_t split(const uint8_t *data, size_t size, char *buf, char *parts[PARTS]) {
        size_t n = 0, o = 0;
        parts[n++] = buf;
        for (size_t i = 0; i < size; i++) {
                if (data[i] == 0xFF && n < PARTS) {
                        buf[o++] = '\0';
                        parts[n++] = buf + o;
                        continue;
                }
                buf[o++] = (char)data[i];
        }
        buf[o] = '\0';
        for (size_t i = n; i < PARTS; i++)
                parts[i] = buf + o;
        return n;
}

/* A format from the input: every '%' not followed by 's' or '%' is doubled,
 * at most 6 conversions %s stay, at most MAX_TOKENS tokens (runs of
 * non-spaces), each of which log_write turns into one field; returns their
 * number. */
#define MAX_TOKENS 40
static size_t make_format(const char *in, char *out, size_t cap, int *convs) {
        size_t o = 0, tokens = 0;
        int prev_space = 1;
        *convs = 0;
        for (const char *p = in; *p && o + 3 < cap; p++) {
                if (*p != ' ' && prev_space && tokens == MAX_TOKENS)
                        break;
                if (*p == '%') {
                        if (p[1] == 's' && *convs < 6) {
                                out[o++] = '%';
                                out[o++] = 's';
                                (*convs)++;
                                p++;
                        } else {
                                out[o++] = '%';
                                out[o++] = '%';
                                if (p[1] == '%')
                                        p++;
                        }
                } else {
                        out[o++] = *p;
                }
                int space = out[o - 1] == ' ';
                if (!space && prev_space)
                        tokens++;
                prev_space = space;
        }
        out[o] = '\0';
        return tokens;
}

static void check(size_t n, int json, size_t want_fields) {
        if (log_parse_line(line, n, json, &lp) != 0)
                abort(); /* not one well-formed line */
        if (lp.n < 4 || strcmp(lp.key[0], "ts") || strcmp(lp.key[1], "level") ||
            strcmp(lp.key[2], "mod") || strcmp(lp.key[3], "msg"))
                abort();
        if (want_fields && lp.n != want_fields)
                abort(); /* a field added, or one lost */
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        if (size < 1 || size > 64 * 1024)
                return 0;
        int json = data[0] & 1;
        char *buf = malloc(size + 1), *fmt = malloc(2 * size + 16);
        char *p[PARTS];
        split(data + 1, size - 1, buf, p);

        /* the code's kind of format: literal keys, %s values */
        size_t n = log_format(line, sizeof line, json, LOG_WARN, p[0], p[1],
                              "outbox_id=%s topic=%s err=%s reason=%s", p[2], p[3], p[4], p[5]);
        check(n, json, 8);
        n = log_format(line, sizeof line, json, LOG_INFO, p[0], p[1],
                       "rows=%zu seconds=%.3f fingerprint=%016llx x=%d v=%s", size,
                       (double)size / 7.0, (unsigned long long)size * 0x9E3779B97F4A7C15ULL,
                       (int)data[0] - 128, p[6]);
        check(n, json, 9);

        /* a format made of input bytes */
        int convs;
        size_t tokens = make_format(p[7], fmt, 2 * size + 16, &convs);
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wformat-nonliteral" /* only %s and %% remain in fmt */
#pragma GCC diagnostic ignored "-Wformat-security"
        n = log_format(line, sizeof line, json, LOG_ERROR, p[0], p[1], fmt, p[2], p[3], p[4], p[5],
                       p[6], p[0]);
#pragma GCC diagnostic pop
        check(n, json, 0);
        /* fields that do not fit are left out whole; all fit when short */
        if (size < 512 && lp.n != 4 + tokens)
                abort();
        (void)convs;
        free(buf);
        free(fmt);
        return 0;
}
