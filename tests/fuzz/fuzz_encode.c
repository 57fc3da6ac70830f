/* fuzz_encode.c - what a row becomes on Kafka (common/encode.c, avroenc.c):
 * arbitrary bytes in every text column, in the topic template, in
 * OUTBOX_ENVELOPE_FIELDS and in headers_json's netstring form (raw, or well
 * formed around arbitrary names and values). Checked besides the sanitizers:
 * the JSON envelope is well-formed JSON whatever the columns hold, the header
 * count stays within ENCODE_MAX_HEADERS, and encode_utf8_clean leaves valid
 * UTF-8. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "avroenc.h"
#include "config.h"
#include "encode.h"
#include "log_parse.h"

#define PARTS 15

static struct avroenc *avro_envelope, *avro_payload;

static void destroy(void) {
        avroenc_destroy(avro_envelope);
        avroenc_destroy(avro_payload);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
        char err[256];
        (void)argc;
        (void)argv;
        atexit(destroy); /* before LeakSanitizer's check at exit */
        avro_envelope = avroenc_new(VALUE_ENVELOPE, NULL, err, sizeof err);
        avro_payload = avroenc_new(VALUE_PAYLOAD, NULL, err, sizeof err);
        return avro_envelope && avro_payload ? 0 : 1;
}

/* A strict JSON reader: 1 when [*p, e) starts with one value (skipped). */
static int json_value(const char **p, const char *e, int depth);

static void ws(const char **p, const char *e) {
        while (*p < e && (**p == ' ' || **p == '\t' || **p == '\n' || **p == '\r'))
                (*p)++;
}

static int json_string(const char **p, const char *e) {
        const char *s = *p;
        if (s >= e || *s++ != '"')
                return 0;
        while (s < e && *s != '"') {
                if ((unsigned char)*s < 0x20)
                        return 0;
                if (*s == '\\') {
                        s++;
                        if (s >= e)
                                return 0;
                        if (*s == 'u') {
                                for (int i = 1; i <= 4; i++)
                                        if (s + i >= e || lp_hex(s[i]) < 0)
                                                return 0;
                                s += 5;
                                continue;
                        }
                        if (!strchr("\"\\/bfnrt", *s) || !*s)
                                return 0;
                }
                s++;
        }
        if (s >= e)
                return 0;
        *p = s + 1;
        return 1;
}

static int json_value(const char **p, const char *e, int depth) {
        ws(p, e);
        if (*p >= e || depth > 64)
                return 0;
        char c = **p;
        if (c == '"')
                return json_string(p, e);
        if (c == '{' || c == '[') {
                char close = c == '{' ? '}' : ']';
                (*p)++;
                ws(p, e);
                if (*p < e && **p == close) {
                        (*p)++;
                        return 1;
                }
                for (;;) {
                        if (c == '{') {
                                ws(p, e);
                                if (!json_string(p, e))
                                        return 0;
                                ws(p, e);
                                if (*p >= e || *(*p)++ != ':')
                                        return 0;
                        }
                        if (!json_value(p, e, depth + 1))
                                return 0;
                        ws(p, e);
                        if (*p < e && **p == ',') {
                                (*p)++;
                                continue;
                        }
                        if (*p < e && **p == close) {
                                (*p)++;
                                return 1;
                        }
                        return 0;
                }
        }
        if (!strncmp(*p, "null", 4) || !strncmp(*p, "true", 4)) {
                *p += 4;
                return 1;
        }
        if (!strncmp(*p, "false", 5)) {
                *p += 5;
                return 1;
        }
        const char *s = *p;
        if (s < e && *s == '-')
                s++;
        if (s >= e || *s < '0' || *s > '9')
                return 0;
        while (s < e && ((*s >= '0' && *s <= '9') || strchr(".eE+-", *s)))
                s++;
        *p = s;
        return 1;
}

static int valid_json(const char *s, size_t n) {
        const char *p = s, *e = s + n;
        if (!json_value(&p, e, 0))
                return 0;
        ws(&p, e);
        return p == e;
}

static int valid_utf8(const char *s) {
        size_t n = strlen(s);
        for (size_t i = 0; i < n;) {
                size_t l = lp_utf8((const unsigned char *)s + i, n - i);
                if (!l)
                        return 0;
                i += l;
        }
        return 1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        if (size < 2 || size > 64 * 1024)
                return 0;
        uint8_t flags = data[0], mode = data[1];
        char *buf = malloc(size + 1), *part[PARTS];
        size_t np = 0, o = 0;
        part[np++] = buf;
        for (size_t i = 2; i < size; i++) {
                if (data[i] == 0xFF && np < PARTS) {
                        buf[o++] = '\0';
                        part[np++] = buf + o;
                } else {
                        buf[o++] = (char)data[i];
                }
        }
        buf[o] = '\0';
        for (size_t i = np; i < PARTS; i++)
                part[i] = buf + o;

        /* headers_json as the lock query writes it: "<len>:<name><len>:<value>..."
         * around the bytes of part 13 split at 0xFE; or part 13 as it is */
        struct buf headers = {0};
        if (mode & 1) {
                const char *s = part[13];
                while (*s) {
                        size_t n = strcspn(s, "\xFE");
                        if (buf_appendf(&headers, "%zu:", n) || buf_append(&headers, s, n))
                                abort();
                        s += n + (s[n] != '\0');
                }
                if (buf_append(&headers, "", 0))
                        abort();
        }

        struct outbox_event ev = {
                .outbox_id = "6f1c2b9e-0000-4000-8000-000000000001",
                .tenant_id = part[1],
                .aggregate_type = part[2],
                .aggregate_id = part[3],
                .aggregate_version = (long long)flags * 1000003LL - 7,
                .event_type = part[4],
                .event_version = mode,
                .topic_name = flags & 1 ? part[5] : NULL,
                .partition_key = flags & 2 ? part[6] : NULL,
                .event_key = flags & 4 ? part[7] : NULL,
                .payload = flags & 8 ? part[8] : NULL,
                .payload_len = strlen(part[8]),
                .headers = mode & 2   ? NULL
                           : mode & 1 ? (headers.data ? headers.data : "")
                                      : part[13],
                .correlation_id = flags & 16 ? part[9] : NULL,
                .causation_id = flags & 32 ? part[10] : NULL,
                .trace_id = flags & 64 ? part[11] : NULL,
                .occurred_at = part[12],
                .occurred_at_epoch = 1.5e9,
                .attempt_count = 1,
                .tid = "(0,1)",
        };

        struct buf out = {0}, scratch = {0};
        char err[256];
        (void)encode_topic(part[0], &ev, &out);

        struct encode_fields fields;
        int have_fields = encode_fields_parse(part[14], &fields, err, sizeof err) == 0;
        const struct encode_fields *f = have_fields ? &fields : NULL;
        volatile unsigned sum = 0; /* reads every byte handed out (ASan checks them) */
        for (size_t i = 0; have_fields && i < fields.n; i++) {
                size_t len;
                const char *v = encode_field_value(&fields.f[i], &ev, &len);
                for (size_t k = 0; v && k < len; k++)
                        sum += (unsigned char)v[k];
        }

        /* the envelope is JSON whatever the columns hold, given a JSON payload */
        struct outbox_event j = ev;
        j.payload = "{\"k\":[1,2.5,null,\"s\"]}";
        j.payload_len = strlen(j.payload);
        if (encode_envelope_json_fields(&j, f, &out) != 0 || !valid_json(out.data, out.len))
                abort();
        (void)encode_envelope_json_fields(&ev, f, &out);

        struct encode_header hdrs[ENCODE_MAX_HEADERS];
        int n = encode_headers_fields(&ev, "outbox-relay", "application/json",
                                      mode & 4 ? "42" : NULL, f, hdrs, &scratch, err, sizeof err);
        if (n > ENCODE_MAX_HEADERS)
                abort();
        for (int i = 0; i < n; i++) {
                sum += (unsigned)strlen(hdrs[i].name);
                for (size_t k = 0; k < hdrs[i].value_len; k++)
                        sum += (unsigned char)hdrs[i].value[k];
        }

        if (ev.payload) {
                (void)avroenc_encode(mode & 8 ? avro_payload : avro_envelope, &ev,
                                     mode & 16 ? 7 : -1, &out, err, sizeof err);
        }

        if (sum == 0xFFFFFFFFu)
                fprintf(stderr, "%u\n", sum); /* keeps the reads */
        char *clean = strdup(part[3]);
        encode_utf8_clean(clean);
        if (!valid_utf8(clean))
                abort();
        free(clean);
        buf_free(&out);
        buf_free(&scratch);
        buf_free(&headers);
        free(buf);
        return 0;
}
