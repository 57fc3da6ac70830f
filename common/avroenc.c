/* avroenc.c - Avro value of a row: schema, canonical form, fingerprint, framing. */
#include "avroenc.h"

#include <avro/errors.h>
#include <avro/generic.h>
#include <avro/io.h>
#include <avro/schema.h>
#include <avro/value.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "avro_schema.h"
#include "config.h"

/* Fields of outbox_envelope.avsc, in order (avroenc_new checks the names). */
enum {
        F_EVENT_ID,
        F_EVENT_TYPE,
        F_EVENT_VERSION,
        F_TENANT_ID,
        F_AGGREGATE_TYPE,
        F_AGGREGATE_ID,
        F_AGGREGATE_VERSION,
        F_OCCURRED_AT,
        F_CORRELATION_ID,
        F_CAUSATION_ID,
        F_TRACE_ID,
        F_PAYLOAD,
        F_COUNT
};
static const char *const field_names[F_COUNT] = {
        "event_id",       "event_type",   "event_version",     "tenant_id",
        "aggregate_type", "aggregate_id", "aggregate_version", "occurred_at",
        "correlation_id", "causation_id", "trace_id",          "payload",
};

struct avroenc {
        int envelope;                /* else the value is the payload string */
        struct encode_fields fields; /* appended envelope fields */
        struct buf json;             /* schema JSON text */
        struct buf canonical;
        uint64_t fingerprint;
        avro_schema_t schema;
        avro_value_iface_t *iface;
        avro_value_t value;
        int have_value;
        struct buf tmp; /* NUL-terminated copies of header members */
};

#define CRC64_EMPTY 0xc15d213aa4d7a795ULL

uint64_t avroenc_crc64(const void *data, size_t len) {
        static uint64_t table[256];
        static int ready;
        if (!ready) { /* idempotent: a race only recomputes the same values */
                for (int i = 0; i < 256; i++) {
                        uint64_t fp = (uint64_t)i;
                        for (int j = 0; j < 8; j++)
                                fp = (fp >> 1) ^ (CRC64_EMPTY & (0 - (fp & 1)));
                        table[i] = fp;
                }
                ready = 1;
        }
        uint64_t fp = CRC64_EMPTY;
        const unsigned char *p = data;
        for (size_t i = 0; i < len; i++)
                fp = (fp >> 8) ^ table[(fp ^ p[i]) & 0xff];
        return fp;
}

static int fullname(avro_schema_t s, struct buf *out) {
        const char *ns = avro_schema_namespace(s);
        const char *name = avro_schema_name(s);
        if (ns && *ns)
                return buf_appendf(out, "\"%s.%s\"", ns, name);
        return buf_appendf(out, "\"%s\"", name);
}

/* Appends the Parsing Canonical Form of s (Avro specification). */
static int canonical(avro_schema_t s, struct buf *out) {
        static const char *const prim[] = {
                [AVRO_STRING] = "\"string\"",   [AVRO_BYTES] = "\"bytes\"",
                [AVRO_INT32] = "\"int\"",       [AVRO_INT64] = "\"long\"",
                [AVRO_FLOAT] = "\"float\"",     [AVRO_DOUBLE] = "\"double\"",
                [AVRO_BOOLEAN] = "\"boolean\"", [AVRO_NULL] = "\"null\"",
        };
        switch (avro_typeof(s)) {
        case AVRO_STRING:
        case AVRO_BYTES:
        case AVRO_INT32:
        case AVRO_INT64:
        case AVRO_FLOAT:
        case AVRO_DOUBLE:
        case AVRO_BOOLEAN:
        case AVRO_NULL: return buf_appendf(out, "%s", prim[avro_typeof(s)]);
        case AVRO_LINK: return fullname(avro_schema_link_target(s), out);
        case AVRO_RECORD: {
                if (buf_append(out, "{\"name\":", 8) || fullname(s, out) ||
                    buf_appendf(out, ",\"type\":\"record\",\"fields\":["))
                        return -1;
                size_t n = avro_schema_record_size(s);
                for (size_t i = 0; i < n; i++)
                        if (buf_appendf(out, "%s{\"name\":\"%s\",\"type\":", i ? "," : "",
                                        avro_schema_record_field_name(s, (int)i)) ||
                            canonical(avro_schema_record_field_get_by_index(s, (int)i), out) ||
                            buf_append(out, "}", 1))
                                return -1;
                return buf_append(out, "]}", 2);
        }
        case AVRO_ENUM: {
                if (buf_append(out, "{\"name\":", 8) || fullname(s, out) ||
                    buf_appendf(out, ",\"type\":\"enum\",\"symbols\":["))
                        return -1;
                int n = avro_schema_enum_number_of_symbols(s);
                for (int i = 0; i < n; i++)
                        if (buf_appendf(out, "%s\"%s\"", i ? "," : "", avro_schema_enum_get(s, i)))
                                return -1;
                return buf_append(out, "]}", 2);
        }
        case AVRO_FIXED:
                return buf_append(out, "{\"name\":", 8) || fullname(s, out) ||
                                       buf_appendf(out, ",\"type\":\"fixed\",\"size\":%lld}",
                                                   (long long)avro_schema_fixed_size(s))
                               ? -1
                               : 0;
        case AVRO_MAP:
                return buf_appendf(out, "{\"type\":\"map\",\"values\":") ||
                                       canonical(avro_schema_map_values(s), out) ||
                                       buf_append(out, "}", 1)
                               ? -1
                               : 0;
        case AVRO_ARRAY:
                return buf_appendf(out, "{\"type\":\"array\",\"items\":") ||
                                       canonical(avro_schema_array_items(s), out) ||
                                       buf_append(out, "}", 1)
                               ? -1
                               : 0;
        case AVRO_UNION: {
                size_t n = avro_schema_union_size(s);
                if (buf_append(out, "[", 1))
                        return -1;
                for (size_t i = 0; i < n; i++)
                        if ((i && buf_append(out, ",", 1)) ||
                            canonical(avro_schema_union_branch(s, (int)i), out))
                                return -1;
                return buf_append(out, "]", 1);
        }
        /* AVRO_INVALID (avro-c 1.12): no schema parsed from text has it. */
        default: return -1;
        }
}

int avroenc_canonicalize(const char *schema_json, struct buf *out, char *errstr,
                         size_t errstr_size) {
        avro_schema_t s = NULL;
        buf_reset(out);
        if (avro_schema_from_json_length(schema_json, strlen(schema_json), &s) != 0) {
                snprintf(errstr, errstr_size, "bad Avro schema: %s", avro_strerror());
                return -1;
        }
        int rc = canonical(s, out);
        avro_schema_decref(s);
        if (rc)
                snprintf(errstr, errstr_size, "cannot write the canonical form");
        return rc;
}

/* The envelope schema text with `fields` appended to the top-level record's
 * fields: the .avsc keeps "fields" last, so its array closes at the last ']'. */
static int envelope_json(const struct encode_fields *fields, struct buf *out) {
        const char *end = strrchr(avro_envelope_avsc, ']');
        if (!end)
                return -1;
        if (buf_append(out, avro_envelope_avsc, (size_t)(end - avro_envelope_avsc)))
                return -1;
        while (out->len && (out->data[out->len - 1] == ' ' || out->data[out->len - 1] == '\n'))
                out->data[--out->len] = '\0';
        for (size_t i = 0; fields && i < fields->n; i++)
                if (buf_appendf(out,
                                ",\n    {\"name\": \"%s\", \"type\": [\"null\", \"string\"], "
                                "\"default\": null}",
                                fields->f[i].name))
                        return -1;
        return buf_appendf(out, "\n  %s", end);
}

struct avroenc *avroenc_new(int value_format, const struct encode_fields *fields, char *errstr,
                            size_t errstr_size) {
        struct avroenc *a = calloc(1, sizeof *a);
        if (!a) {
                snprintf(errstr, errstr_size, "out of memory");
                return NULL;
        }
        a->envelope = value_format == VALUE_ENVELOPE;
        if (a->envelope && fields)
                a->fields = *fields;
        int rc = a->envelope ? envelope_json(&a->fields, &a->json)
                             : buf_appendf(&a->json, "\"string\"");
        if (rc) {
                snprintf(errstr, errstr_size, "out of memory");
                goto fail;
        }
        if (avro_schema_from_json_length(a->json.data, a->json.len, &a->schema) != 0) {
                snprintf(errstr, errstr_size, "bad Avro schema: %s", avro_strerror());
                goto fail;
        }
        if (a->envelope) {
                size_t want = F_COUNT + a->fields.n;
                if (avro_schema_record_size(a->schema) != want) {
                        snprintf(errstr, errstr_size, "envelope schema has %zu fields, want %zu",
                                 avro_schema_record_size(a->schema), want);
                        goto fail;
                }
                for (size_t i = 0; i < want; i++) {
                        const char *name =
                                i < F_COUNT ? field_names[i] : a->fields.f[i - F_COUNT].name;
                        if (strcmp(avro_schema_record_field_name(a->schema, (int)i), name)) {
                                snprintf(errstr, errstr_size,
                                         "envelope schema field %zu is '%s', want '%s'", i,
                                         avro_schema_record_field_name(a->schema, (int)i), name);
                                goto fail;
                        }
                }
        }
        if (canonical(a->schema, &a->canonical)) {
                snprintf(errstr, errstr_size, "cannot write the canonical form");
                goto fail;
        }
        a->fingerprint = avroenc_crc64(a->canonical.data, a->canonical.len);
        a->iface = avro_generic_class_from_schema(a->schema);
        if (!a->iface || avro_generic_value_new(a->iface, &a->value) != 0) {
                snprintf(errstr, errstr_size, "avro: %s", avro_strerror());
                goto fail;
        }
        a->have_value = 1;
        return a;
fail:
        avroenc_destroy(a);
        return NULL;
}

void avroenc_destroy(struct avroenc *a) {
        if (!a)
                return;
        if (a->have_value)
                avro_value_decref(&a->value);
        if (a->iface)
                avro_value_iface_decref(a->iface);
        if (a->schema)
                avro_schema_decref(a->schema);
        buf_free(&a->json);
        buf_free(&a->canonical);
        buf_free(&a->tmp);
        free(a);
}

const char *avroenc_schema_json(const struct avroenc *a) {
        return a->json.data;
}
const char *avroenc_canonical_form(const struct avroenc *a) {
        return a->canonical.data;
}
uint64_t avroenc_fingerprint(const struct avroenc *a) {
        return a->fingerprint;
}

/* Sets a string (len bytes, NUL at s[len]) on v. */
static int set_str(avro_value_t *v, const char *s, size_t len) {
        return avro_value_set_string_len(v, s, len + 1);
}

static int set_field_str(avro_value_t *rec, int idx, const char *s) {
        avro_value_t f;
        return avro_value_get_by_index(rec, (size_t)idx, &f, NULL) || set_str(&f, s, strlen(s));
}

/* Sets a ["null","string"] union field from len bytes at s (NULL: null). */
static int set_field_opt(struct avroenc *a, avro_value_t *rec, size_t idx, const char *s,
                         size_t len) {
        avro_value_t f, branch;
        if (avro_value_get_by_index(rec, idx, &f, NULL))
                return -1;
        if (!s)
                return avro_value_set_branch(&f, 0, &branch) || avro_value_set_null(&branch);
        if (avro_value_set_branch(&f, 1, &branch))
                return -1;
        if (s[len] == '\0')
                return set_str(&branch, s, len);
        buf_reset(&a->tmp); /* not NUL-terminated (a header member): copy */
        return buf_append(&a->tmp, s, len) || set_str(&branch, a->tmp.data, len);
}

static int fill_envelope(struct avroenc *a, const struct outbox_event *ev) {
        avro_value_t *rec = &a->value, f;
        if (set_field_str(rec, F_EVENT_ID, ev->outbox_id) ||
            set_field_str(rec, F_EVENT_TYPE, ev->event_type) ||
            avro_value_get_by_index(rec, F_EVENT_VERSION, &f, NULL) ||
            avro_value_set_int(&f, ev->event_version) ||
            set_field_str(rec, F_TENANT_ID, ev->tenant_id) ||
            set_field_str(rec, F_AGGREGATE_TYPE, ev->aggregate_type) ||
            set_field_str(rec, F_AGGREGATE_ID, ev->aggregate_id) ||
            avro_value_get_by_index(rec, F_AGGREGATE_VERSION, &f, NULL) ||
            avro_value_set_long(&f, ev->aggregate_version) ||
            set_field_str(rec, F_OCCURRED_AT, ev->occurred_at) ||
            set_field_opt(a, rec, F_CORRELATION_ID, ev->correlation_id,
                          ev->correlation_id ? strlen(ev->correlation_id) : 0) ||
            set_field_opt(a, rec, F_CAUSATION_ID, ev->causation_id,
                          ev->causation_id ? strlen(ev->causation_id) : 0) ||
            set_field_opt(a, rec, F_TRACE_ID, ev->trace_id,
                          ev->trace_id ? strlen(ev->trace_id) : 0) ||
            avro_value_get_by_index(rec, F_PAYLOAD, &f, NULL) ||
            set_str(&f, ev->payload, ev->payload_len))
                return -1;
        for (size_t i = 0; i < a->fields.n; i++) {
                size_t len;
                const char *v = encode_field_value(&a->fields.f[i], ev, &len);
                if (set_field_opt(a, rec, F_COUNT + i, v, len))
                        return -1;
        }
        return 0;
}

int avroenc_encode(struct avroenc *a, const struct outbox_event *ev, long long schema_id,
                   struct buf *out, char *errstr, size_t errstr_size) {
        buf_reset(out);
        if (!ev->payload) {
                snprintf(errstr, errstr_size, "a tombstone has no Avro value");
                return -1;
        }
        avro_value_reset(&a->value);
        /* avro-c's allocator, as malloc, says ENOMEM when memory runs out */
        errno = 0;
        int rc = a->envelope ? fill_envelope(a, ev)
                             : set_str(&a->value, ev->payload, ev->payload_len);
        if (rc) {
                snprintf(errstr, errstr_size, "avro: %s", avro_strerror());
                return errno == ENOMEM ? AVROENC_NOMEM : -1;
        }
        unsigned char head[10];
        size_t hlen;
        if (schema_id < 0) {
                head[0] = 0xC3;
                head[1] = 0x01;
                for (int i = 0; i < 8; i++)
                        head[2 + i] = (unsigned char)(a->fingerprint >> (8 * i));
                hlen = 10;
        } else {
                head[0] = 0;
                for (int i = 0; i < 4; i++)
                        head[1 + i] =
                                (unsigned char)((unsigned long long)schema_id >> (24 - 8 * i));
                hlen = 5;
        }
        size_t size = 0;
        errno = 0;
        if (avro_value_sizeof(&a->value, &size) != 0) {
                snprintf(errstr, errstr_size, "avro: %s", avro_strerror());
                return errno == ENOMEM ? AVROENC_NOMEM : -1;
        }
        if (buf_append(out, head, hlen) || buf_reserve(out, size)) {
                snprintf(errstr, errstr_size, "out of memory");
                return AVROENC_NOMEM;
        }
        avro_writer_t w = avro_writer_memory(out->data + out->len, (int64_t)size);
        if (!w) {
                snprintf(errstr, errstr_size, "out of memory");
                return AVROENC_NOMEM;
        }
        rc = avro_value_write(w, &a->value);
        int64_t written = avro_writer_tell(w);
        avro_writer_free(w);
        if (rc != 0 || written != (int64_t)size) {
                snprintf(errstr, errstr_size, "avro: cannot write the value: %s", avro_strerror());
                return -1;
        }
        out->len += size;
        out->data[out->len] = '\0';
        return 0;
}
