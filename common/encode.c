/* encode.c - topic, envelope and headers of one outbox row. */
#include "encode.h"

#include <ctype.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int buf_reserve(struct buf *b, size_t extra) {
        if (b->len + extra + 1 <= b->cap)
                return 0;
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + extra + 1)
                cap *= 2;
        char *d = realloc(b->data, cap);
        if (!d)
                return -1;
        b->data = d;
        b->cap = cap;
        return 0;
}

int buf_append(struct buf *b, const void *p, size_t n) {
        if (buf_reserve(b, n) != 0)
                return -1;
        memcpy(b->data + b->len, p, n);
        b->len += n;
        b->data[b->len] = '\0';
        return 0;
}

int buf_appendf(struct buf *b, const char *fmt, ...) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(NULL, 0, fmt, ap);
        va_end(ap);
        if (n < 0 || buf_reserve(b, (size_t)n) != 0)
                return -1;
        va_start(ap, fmt);
        vsnprintf(b->data + b->len, (size_t)n + 1, fmt, ap);
        va_end(ap);
        b->len += (size_t)n;
        return 0;
}

/* Decimal digits of v, written backwards ending at end; returns the start. */
static char *fmt_ll(char *end, long long v) {
        unsigned long long u = v < 0 ? 0ULL - (unsigned long long)v : (unsigned long long)v;
        char *p = end;
        do
                *--p = (char)('0' + u % 10);
        while (u /= 10);
        if (v < 0)
                *--p = '-';
        return p;
}

int buf_append_ll(struct buf *b, long long v) {
        char tmp[24];
        char *start = fmt_ll(tmp + sizeof tmp, v);
        return buf_append(b, start, (size_t)(tmp + sizeof tmp - start));
}

int buf_append_json_string(struct buf *b, const char *s) {
        if (!s)
                return buf_append(b, "null", 4);
        if (buf_append(b, "\"", 1) != 0)
                return -1;
        const char *run = s;
        for (const char *p = s; *p; p++) {
                unsigned char c = (unsigned char)*p;
                if (c >= 0x20 && c != '"' && c != '\\')
                        continue;
                if (buf_append(b, run, (size_t)(p - run)) != 0)
                        return -1;
                int rc;
                switch (c) {
                case '"': rc = buf_append(b, "\\\"", 2); break;
                case '\\': rc = buf_append(b, "\\\\", 2); break;
                case '\n': rc = buf_append(b, "\\n", 2); break;
                case '\r': rc = buf_append(b, "\\r", 2); break;
                case '\t': rc = buf_append(b, "\\t", 2); break;
                default: {
                        char u[6] = {'\\',
                                     'u',
                                     '0',
                                     '0',
                                     "0123456789abcdef"[c >> 4],
                                     "0123456789abcdef"[c & 15]};
                        rc = buf_append(b, u, sizeof u);
                        break;
                }
                }
                if (rc != 0)
                        return -1;
                run = p + 1;
        }
        return buf_append(b, run, strlen(run)) || buf_append(b, "\"", 1) ? -1 : 0;
}

void buf_reset(struct buf *b) {
        b->len = 0;
        if (b->data)
                b->data[0] = '\0';
}

void encode_utf8_clean(char *s) {
        unsigned char *p = (unsigned char *)s;
        while (*p) {
                size_t n = *p < 0x80                  ? 1
                           : *p >= 0xC2 && *p <= 0xDF ? 2
                           : (*p & 0xF0) == 0xE0      ? 3
                           : *p >= 0xF0 && *p <= 0xF4 ? 4
                                                      : 0;
                size_t i = 1;
                while (i < n && (p[i] & 0xC0) == 0x80)
                        i++;
                /* no overlong forms, surrogates or code points past U+10FFFF */
                int bad = n == 0 ||
                          (i == n && n > 2 &&
                           ((p[0] == 0xE0 && p[1] < 0xA0) || (p[0] == 0xED && p[1] > 0x9F) ||
                            (p[0] == 0xF0 && p[1] < 0x90) || (p[0] == 0xF4 && p[1] > 0x8F)));
                if (!bad && i == n) {
                        p += n;
                } else if (!bad && p[i] == '\0') {
                        *p = '\0'; /* a character cut at the end */
                        return;
                } else {
                        *p++ = '?';
                }
        }
}

/* Bytes of the UTF-8 character that starts with byte c: 1 to 4, or 0 for a
 * byte no character starts with (a continuation byte, 0xC0, 0xC1, 0xF5-0xFF). */
static size_t utf8_lead(unsigned char c) {
        return c < 0x80                 ? 1
               : c >= 0xC2 && c <= 0xDF ? 2
               : (c & 0xF0) == 0xE0     ? 3
               : c >= 0xF0 && c <= 0xF4 ? 4
                                        : 0;
}

size_t encode_utf8_prefix(const char *s, size_t max) {
        size_t len = strlen(s);
        if (len <= max)
                return len;
        /* step back over continuation bytes to the start of the character
         * that the cut would split, unless the cut falls right after it */
        size_t cut = max;
        while (cut > 0 && ((unsigned char)s[cut] & 0xC0) == 0x80)
                cut--;
        return cut;
}

int encode_utf8_printable(const char *s) {
        const unsigned char *p = (const unsigned char *)s;
        while (*p) {
                size_t n = utf8_lead(*p);
                if (n == 0 || *p < 0x20 || *p == 0x7F)
                        return 0;
                for (size_t i = 1; i < n; i++)
                        if ((p[i] & 0xC0) != 0x80)
                                return 0;
                /* no overlong forms, surrogates, code points past U+10FFFF,
                 * or C1 controls (U+0080-U+009F) */
                if ((p[0] == 0xE0 && p[1] < 0xA0) || (p[0] == 0xED && p[1] > 0x9F) ||
                    (p[0] == 0xF0 && p[1] < 0x90) || (p[0] == 0xF4 && p[1] > 0x8F) ||
                    (p[0] == 0xC2 && p[1] < 0xA0))
                        return 0;
                p += n;
        }
        return 1;
}

static int topic_char(char c) {
        return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
               c == '.' || c == '_' || c == '-';
}

int encode_topic_is_legal(const char *name) {
        size_t n = strlen(name);
        if (n == 0 || n > ENCODE_TOPIC_MAX || !strcmp(name, ".") || !strcmp(name, ".."))
                return 0;
        for (size_t i = 0; i < n; i++)
                if (!topic_char(name[i]))
                        return 0;
        return 1;
}

/* The placeholders of a topic template and the columns they stand for. */
static const struct {
        const char *name;
        size_t len;
        size_t off;
        const char *column;
} topic_ph[] = {
        {"{aggregate_type}", 16, offsetof(struct outbox_event, aggregate_type), "aggregate_type"},
        {"{event_type}", 12, offsetof(struct outbox_event, event_type), "event_type"},
        {"{tenant_id}", 11, offsetof(struct outbox_event, tenant_id), "tenant_id"},
};
#define TOPIC_PH (sizeof topic_ph / sizeof topic_ph[0])

static const char *topic_value(const struct outbox_event *ev, size_t i) {
        return *(const char *const *)((const char *)ev + topic_ph[i].off);
}

const char *encode_topic_column(const char *template, const struct outbox_event *ev) {
        const char *longest = NULL;
        size_t longest_len = 0;
        if (ev->topic_name && *ev->topic_name)
                return "topic_name";
        for (const char *p = strchr(template, '{'); p; p = strchr(p + 1, '{')) {
                for (size_t i = 0; i < TOPIC_PH; i++) {
                        if (strncmp(p, topic_ph[i].name, topic_ph[i].len) != 0)
                                continue;
                        const char *v = topic_value(ev, i);
                        for (const char *c = v; *c; c++)
                                if (!topic_char(*c))
                                        return topic_ph[i].column;
                        if (!longest || strlen(v) > longest_len) {
                                longest = topic_ph[i].column;
                                longest_len = strlen(v);
                        }
                }
        }
        return longest ? longest : "topic_name";
}

void buf_free(struct buf *b) {
        free(b->data);
        memset(b, 0, sizeof *b);
}

int encode_topic(const char *template, const struct outbox_event *ev, struct buf *out) {
        buf_reset(out);
        if (ev->topic_name && *ev->topic_name)
                return buf_append(out, ev->topic_name, strlen(ev->topic_name));
        for (const char *p = template; *p;) {
                size_t i = TOPIC_PH;
                if (*p == '{')
                        for (i = 0; i < TOPIC_PH; i++)
                                if (!strncmp(p, topic_ph[i].name, topic_ph[i].len))
                                        break;
                if (i < TOPIC_PH) {
                        const char *v = topic_value(ev, i);
                        if (buf_append(out, v, strlen(v)) != 0)
                                return -1;
                        p += topic_ph[i].len;
                } else {
                        size_t run = strcspn(p + 1, "{") + 1; /* up to the next '{' after p */
                        if (buf_append(out, p, run) != 0)
                                return -1;
                        p += run;
                }
        }
        /* terminated and allocated even when empty: an empty topic is not
         * a legal name, which the caller tells (encode_topic_is_legal) */
        return buf_append(out, "", 0);
}

int encode_envelope_json(const struct outbox_event *ev, struct buf *out) {
        return encode_envelope_json_fields(ev, NULL, out);
}

/* Keys of the envelope itself (docs/DESIGN.md), in order. */
static const char *const envelope_keys[] = {
        "event_id",       "event_type",   "event_version",     "tenant_id",
        "aggregate_type", "aggregate_id", "aggregate_version", "occurred_at",
        "correlation_id", "causation_id", "trace_id",          "payload",
};

static int valid_name(const char *s) {
        if (!*s || !(isalpha((unsigned char)*s) || *s == '_'))
                return 0;
        for (; *s; s++)
                if (!(isalnum((unsigned char)*s) || *s == '_'))
                        return 0;
        return 1;
}

int encode_fields_parse(const char *spec, struct encode_fields *out, char *errstr,
                        size_t errstr_size) {
        static const struct {
                const char *column;
                int source;
        } columns[] = {
                {"event_key", FIELD_EVENT_KEY},
                {"partition_key", FIELD_PARTITION_KEY},
                {"topic_name", FIELD_TOPIC_NAME},
        };
        memset(out, 0, sizeof *out);
        const char *p = spec ? spec : "";
        while (*p) {
                while (*p == ' ' || *p == ',')
                        p++;
                if (!*p)
                        break;
                size_t len = strcspn(p, ",");
                char item[256];
                while (len && p[len - 1] == ' ')
                        len--;
                if (len >= sizeof item) {
                        snprintf(errstr, errstr_size, "entry too long: '%.40s...'", p);
                        return -1;
                }
                memcpy(item, p, len);
                item[len] = '\0';
                p += len;
                while (*p == ' ')
                        p++;
                if (out->n == ENCODE_MAX_FIELDS) {
                        snprintf(errstr, errstr_size, "more than %d entries", ENCODE_MAX_FIELDS);
                        return -1;
                }
                struct encode_field *f = &out->f[out->n];
                char *colon = strchr(item, ':');
                const char *name = NULL;
                if (colon) {
                        *colon = '\0';
                        name = colon + 1;
                }
                size_t i;
                for (i = 0; i < sizeof columns / sizeof columns[0]; i++)
                        if (!strcmp(item, columns[i].column))
                                break;
                if (i < sizeof columns / sizeof columns[0]) {
                        f->source = columns[i].source;
                        if (!name)
                                name = columns[i].column;
                } else if (!strncmp(item, "headers_json.", 13) && item[13]) {
                        f->source = FIELD_HEADER;
                        if (strlen(item + 13) >= sizeof f->member) {
                                snprintf(errstr, errstr_size, "member name too long in '%s'", item);
                                return -1;
                        }
                        snprintf(f->member, sizeof f->member, "%s", item + 13);
                        if (!name)
                                name = f->member;
                } else {
                        snprintf(errstr, errstr_size,
                                 "unknown source '%s' (expected event_key, partition_key, "
                                 "topic_name or headers_json.<member>, each optionally :name)",
                                 item);
                        return -1;
                }
                if (!valid_name(name) || strlen(name) >= ENCODE_FIELD_NAME_MAX) {
                        snprintf(errstr, errstr_size,
                                 "'%s' is not a valid field name ([A-Za-z_][A-Za-z0-9_]*, "
                                 "at most %d bytes; give one with :name)",
                                 name, ENCODE_FIELD_NAME_MAX - 1);
                        return -1;
                }
                for (i = 0; i < sizeof envelope_keys / sizeof envelope_keys[0]; i++)
                        if (!strcmp(name, envelope_keys[i])) {
                                snprintf(errstr, errstr_size,
                                         "field name '%s' is already an envelope key", name);
                                return -1;
                        }
                for (i = 0; i < out->n; i++)
                        if (!strcmp(name, out->f[i].name)) {
                                snprintf(errstr, errstr_size, "field name '%s' given twice", name);
                                return -1;
                        }
                snprintf(f->name, sizeof f->name, "%s", name);
                out->n++;
        }
        return 0;
}

/* Reads one netstring "<len>:<bytes>" at *p (end e); returns 0 and advances. */
static int netstring(const char **p, const char *e, const char **val, size_t *len);

const char *encode_field_value(const struct encode_field *f, const struct outbox_event *ev,
                               size_t *len) {
        const char *v = NULL;
        *len = 0;
        switch (f->source) {
        case FIELD_EVENT_KEY: v = ev->event_key; break;
        case FIELD_PARTITION_KEY: v = ev->partition_key; break;
        case FIELD_TOPIC_NAME: v = ev->topic_name; break;
        case FIELD_HEADER: {
                if (!ev->headers)
                        return NULL;
                size_t mlen = strlen(f->member);
                const char *p = ev->headers, *e = p + strlen(p);
                while (p < e) {
                        const char *name, *val;
                        size_t nlen, vlen;
                        if (netstring(&p, e, &name, &nlen) || netstring(&p, e, &val, &vlen))
                                return NULL;
                        if (nlen == mlen && !memcmp(name, f->member, mlen)) {
                                *len = vlen;
                                return val;
                        }
                }
                return NULL;
        }
        }
        if (v)
                *len = strlen(v);
        return v;
}

int encode_envelope_json_fields(const struct outbox_event *ev, const struct encode_fields *fields,
                                struct buf *out) {
        buf_reset(out);
        int rc = buf_append(out, "{\"event_id\":", 12) ||
                 buf_append_json_string(out, ev->outbox_id) ||
                 buf_append(out, ",\"event_type\":", 14) ||
                 buf_append_json_string(out, ev->event_type) ||
                 buf_append(out, ",\"event_version\":", 17) ||
                 buf_append_ll(out, ev->event_version) || buf_append(out, ",\"tenant_id\":", 13) ||
                 buf_append_json_string(out, ev->tenant_id) ||
                 buf_append(out, ",\"aggregate_type\":", 18) ||
                 buf_append_json_string(out, ev->aggregate_type) ||
                 buf_append(out, ",\"aggregate_id\":", 16) ||
                 buf_append_json_string(out, ev->aggregate_id) ||
                 buf_append(out, ",\"aggregate_version\":", 21) ||
                 buf_append_ll(out, ev->aggregate_version) ||
                 buf_append(out, ",\"occurred_at\":", 15) ||
                 buf_append_json_string(out, ev->occurred_at) ||
                 buf_append(out, ",\"correlation_id\":", 18) ||
                 buf_append_json_string(out, ev->correlation_id) ||
                 buf_append(out, ",\"causation_id\":", 16) ||
                 buf_append_json_string(out, ev->causation_id) ||
                 buf_append(out, ",\"trace_id\":", 12) ||
                 buf_append_json_string(out, ev->trace_id) || buf_append(out, ",\"payload\":", 11);
        if (rc)
                return -1;
        if (ev->payload)
                rc = buf_append(out, ev->payload, ev->payload_len);
        else
                rc = buf_append(out, "null", 4);
        for (size_t i = 0; !rc && fields && i < fields->n; i++) {
                size_t vlen;
                const char *v = encode_field_value(&fields->f[i], ev, &vlen);
                rc = buf_appendf(out, ",\"%s\":", fields->f[i].name);
                if (!rc && !v) {
                        rc = buf_append(out, "null", 4);
                } else if (!rc) {
                        /* header members are not NUL-terminated: escape a copy */
                        char *copy = strndup(v, vlen);
                        rc = !copy || buf_append_json_string(out, copy);
                        free(copy);
                }
        }
        return rc || buf_append(out, "}", 1) ? -1 : 0;
}

static int netstring(const char **p, const char *e, const char **val, size_t *len) {
        size_t n = 0;
        const char *q = *p;
        if (q >= e || *q < '0' || *q > '9')
                return -1;
        while (q < e && *q >= '0' && *q <= '9') {
                n = n * 10 + (size_t)(*q++ - '0');
                if (n > (size_t)(e - *p))
                        return -1;
        }
        if (q >= e || *q != ':' || n > (size_t)(e - q - 1))
                return -1;
        *val = q + 1;
        *len = n;
        *p = q + 1 + n;
        return 0;
}

int encode_headers(const struct outbox_event *ev, const char *producer, const char *content_type,
                   const char *schema_id, struct encode_header *hdrs, struct buf *scratch,
                   char *errstr, size_t errstr_size) {
        return encode_headers_fields(ev, producer, content_type, schema_id, NULL, hdrs, scratch,
                                     errstr, errstr_size);
}

/* Nonzero when `fields` places headers_json member `name` (nlen bytes). */
static int placed_member(const struct encode_fields *fields, const char *name, size_t nlen) {
        for (size_t i = 0; fields && i < fields->n; i++)
                if (fields->f[i].source == FIELD_HEADER && strlen(fields->f[i].member) == nlen &&
                    !memcmp(fields->f[i].member, name, nlen))
                        return 1;
        return 0;
}

static int placed_event_key(const struct encode_fields *fields) {
        for (size_t i = 0; fields && i < fields->n; i++)
                if (fields->f[i].source == FIELD_EVENT_KEY)
                        return 1;
        return 0;
}

/* Appends v and its NUL to scratch, which has room; returns where it went. */
static const char *scratch_number(struct buf *scratch, long long v) {
        char tmp[24];
        char *start = fmt_ll(tmp + sizeof tmp, v);
        size_t n = (size_t)(tmp + sizeof tmp - start);
        char *out = scratch->data + scratch->len;
        memcpy(out, start, n);
        out[n] = '\0';
        scratch->len += n + 1;
        return out;
}

int encode_headers_fields(const struct outbox_event *ev, const char *producer,
                          const char *content_type, const char *schema_id,
                          const struct encode_fields *fields, struct encode_header *hdrs,
                          struct buf *scratch, char *errstr, size_t errstr_size) {
        if (!ev->headers) {
                snprintf(errstr, errstr_size, "headers_json is not a JSON object");
                return -1;
        }
        /* Numbers go into scratch first; scratch must not grow after we hand
         * out pointers into it, so reserve everything up front. */
        size_t extra = strlen(ev->headers) + 64;
        buf_reset(scratch);
        if (buf_reserve(scratch, extra + 64) != 0) {
                snprintf(errstr, errstr_size, "out of memory");
                return ENCODE_NOMEM;
        }
        const char *event_version = scratch_number(scratch, ev->event_version);
        const char *aggregate_version = scratch_number(scratch, ev->aggregate_version);

        struct encode_header fixed[] = {
                {"event-id", ev->outbox_id, 0},
                {"event-type", ev->event_type, 0},
                {"event-version", event_version, 0},
                {"tenant-id", ev->tenant_id, 0},
                {"aggregate-type", ev->aggregate_type, 0},
                {"aggregate-id", ev->aggregate_id, 0},
                {"aggregate-version", aggregate_version, 0},
                {"occurred-at", ev->occurred_at, 0},
                {"producer", producer, 0},
                {"content-type", content_type, 0},
                {"correlation-id", ev->correlation_id, 0},
                {"causation-id", ev->causation_id, 0},
                {"trace-id", ev->trace_id, 0},
                {"event-key", placed_event_key(fields) ? NULL : ev->event_key, 0},
                {"schema-id", schema_id, 0},
        };
        const size_t nfixed = sizeof fixed / sizeof fixed[0];
        _Static_assert(sizeof fixed / sizeof fixed[0] == ENCODE_FIXED_HEADERS,
                       "ENCODE_FIXED_HEADERS");
        int n = 0, members = 0;
        for (size_t i = 0; i < nfixed; i++) {
                if (!fixed[i].value)
                        continue;
                hdrs[n] = fixed[i];
                hdrs[n++].value_len = strlen(fixed[i].value);
        }

        const char *p = ev->headers, *e = p + strlen(p);
        while (p < e) {
                const char *name, *val;
                size_t nlen, vlen;
                if (netstring(&p, e, &name, &nlen) || netstring(&p, e, &val, &vlen)) {
                        snprintf(errstr, errstr_size, "headers_json could not be decoded");
                        return -1;
                }
                if (++members > ENCODE_MAX_HEADER_MEMBERS) {
                        snprintf(errstr, errstr_size,
                                 "headers_json has more than %d members (the limit)",
                                 ENCODE_MAX_HEADER_MEMBERS);
                        return -1;
                }
                /* The name must be NUL-terminated for librdkafka: copy it. */
                char *nm = scratch->data + scratch->len;
                memcpy(nm, name, nlen);
                nm[nlen] = '\0';
                scratch->len += nlen + 1;
                size_t i;
                for (i = 0; i < nfixed; i++)
                        if (!strcmp(fixed[i].name, nm))
                                break;
                if (i < nfixed || placed_member(fields, name, nlen))
                        continue; /* a member never replaces a fixed header */
                hdrs[n].name = nm;
                hdrs[n].value = val;
                hdrs[n++].value_len = vlen;
        }
        return n;
}

/* The proleptic Gregorian date of day `z` since 1970-01-01 (Howard
 * Hinnant's civil_from_days). */
static void civil_from_days(long long z, long long *y, unsigned *m, unsigned *d) {
        z += 719468;
        long long era = (z >= 0 ? z : z - 146096) / 146097;
        unsigned doe = (unsigned)(z - era * 146097);
        unsigned yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
        unsigned doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        unsigned mp = (5 * doy + 2) / 153;
        *d = doy - (153 * mp + 2) / 5 + 1;
        *m = mp < 10 ? mp + 3 : mp - 9;
        *y = (long long)yoe + era * 400 + (*m <= 2);
}

int encode_rfc3339_us(long long us, char *out, size_t out_size) {
        const long long day_us = 86400LL * 1000000LL;
        /* 2000-01-01 is day 10957 since 1970; PostgreSQL's range (4713 BC to
         * 294276 AD) keeps these sums far from overflowing, but its
         * infinities are the extremes of int64 */
        if (out_size)
                out[0] = '\0';
        if (us == INT64_MAX || us == INT64_MIN)
                return -1;
        long long days = us / day_us, rem = us % day_us;
        if (rem < 0) {
                rem += day_us;
                days--;
        }
        long long y;
        unsigned m, d;
        civil_from_days(days + 10957, &y, &m, &d);
        if (y < 1 || y > 9999)
                return -1;
        long long secs = rem / 1000000;
        int n = snprintf(out, out_size, "%04lld-%02u-%02uT%02lld:%02lld:%02lld.%06lldZ", y, m, d,
                         secs / 3600, secs / 60 % 60, secs % 60, rem % 1000000);
        return n < 0 || (size_t)n >= out_size ? -1 : 0;
}
