/* encode.h - the parts of a row's Kafka message: topic, JSON envelope,
 * headers (message.h puts them together), and the byte buffer they are
 * written into. Pure functions over struct outbox_event; no I/O. */
#ifndef OUTBOX_ENCODE_H
#define OUTBOX_ENCODE_H

#include <stddef.h>

#include "event.h"

/* A growable byte buffer. Zero-initialise; buf_free() releases. */
struct buf {
        char *data;
        size_t len, cap;
};

/* Makes room for `extra` more bytes (plus a NUL) without changing len. */
int buf_reserve(struct buf *b, size_t extra) __attribute__((warn_unused_result));
int buf_append(struct buf *b, const void *p, size_t n) __attribute__((warn_unused_result));
int buf_appendf(struct buf *b, const char *fmt, ...)
        __attribute__((format(printf, 2, 3), warn_unused_result));
/* Appends v in decimal. */
int buf_append_ll(struct buf *b, long long v) __attribute__((warn_unused_result));
/* Appends s as a JSON string literal (quotes included), or null when s is NULL. */
int buf_append_json_string(struct buf *b, const char *s) __attribute__((warn_unused_result));
void buf_reset(struct buf *b);

/* Makes s valid UTF-8 in place: a sequence cut at the end is dropped, any
 * other invalid byte becomes '?'. (Messages are cut to fixed sizes and may
 * quote foreign text; PostgreSQL rejects invalid UTF-8.) */
void encode_utf8_clean(char *s);

/* Writes a PostgreSQL timestamptz (microseconds since 2000-01-01 00:00:00
 * UTC) as RFC 3339 in UTC with microseconds ("2024-05-01T10:00:00.000000Z")
 * into out (at least 28 bytes). -1 when RFC 3339 cannot write it: years
 * before 0001 or after 9999, 'infinity' and '-infinity' (INT64_MAX,
 * INT64_MIN); out is then "". */
int encode_rfc3339_us(long long us, char *out, size_t out_size);
void buf_free(struct buf *b);

/* The length of the longest prefix of s that has at most `max` bytes and
 * does not end inside a UTF-8 sequence: s cut to max bytes on a character
 * boundary, as PostgreSQL cuts a name in a UTF-8 database (the NOTIFY
 * channel, schemas/postgres/005). strlen(s) when s is no longer. */
size_t encode_utf8_prefix(const char *s, size_t max);

/* 1 when s is valid UTF-8 with no control characters (C0, DEL, C1): text
 * that can go into a log line, a header or locked_by as it is; else 0. */
int encode_utf8_printable(const char *s);

/* Kafka's rule for a topic name: 1 to ENCODE_TOPIC_MAX characters of
 * [a-zA-Z0-9._-], neither "." nor "..". 1 when `name` is legal, else 0. */
#define ENCODE_TOPIC_MAX 249
int encode_topic_is_legal(const char *name);

/* Which column made `topic` (built by encode_topic() from `template` and ev)
 * illegal: "topic_name" when the row names its topic, else the first column
 * the template places whose value has a character Kafka refuses, else the
 * one with the longest value (the name is too long). Static string. */
const char *encode_topic_column(const char *template, const struct outbox_event *ev);

/* Writes the topic: ev->topic_name, else `template` with {aggregate_type},
 * {event_type} and {tenant_id} replaced (possibly empty, when the columns
 * it places are). 0, or -1 when memory ran out. */
int encode_topic(const char *template, const struct outbox_event *ev, struct buf *out)
        __attribute__((warn_unused_result));

/* Writes the docs/DESIGN.md JSON envelope (every key present, null where NULL, the
 * payload JSON embedded as is). 0 on success. */
int encode_envelope_json(const struct outbox_event *ev, struct buf *out)
        __attribute__((warn_unused_result));

/* Extra envelope fields (OUTBOX_ENVELOPE_FIELDS, Debezium's
 * table.fields.additional.placement=<column>:envelope:<alias>): a column that
 * is not in the envelope, or a headers_json member, placed in the envelope
 * under `name` (always a string or null). A placed headers_json member and a
 * placed event_key are no longer sent as headers. */
enum encode_field_source {
        FIELD_EVENT_KEY = 0,
        FIELD_PARTITION_KEY,
        FIELD_TOPIC_NAME,
        FIELD_HEADER /* headers_json.<member> */
};

#define ENCODE_MAX_FIELDS     16
#define ENCODE_FIELD_NAME_MAX 64

struct encode_field {
        int source;                       /* enum encode_field_source */
        char member[128];                 /* FIELD_HEADER: the headers_json member */
        char name[ENCODE_FIELD_NAME_MAX]; /* key in the envelope (an Avro name) */
};

struct encode_fields {
        struct encode_field f[ENCODE_MAX_FIELDS];
        size_t n;
};

/* Parses OUTBOX_ENVELOPE_FIELDS: comma-separated `source[:name]`, source one of
 * event_key, partition_key, topic_name, headers_json.<member>; name defaults
 * to the column or member name and must match [A-Za-z_][A-Za-z0-9_]*, differ
 * from the envelope's own keys and from each other. An empty spec gives n = 0.
 * 0, or -1 with the reason (without the variable name) in errstr. */
int encode_fields_parse(const char *spec, struct encode_fields *out, char *errstr,
                        size_t errstr_size) __attribute__((warn_unused_result));

/* The value of field f for ev: a pointer into ev (not NUL-terminated for
 * header members) and its length, or NULL when the column is NULL or the
 * member absent. */
const char *encode_field_value(const struct encode_field *f, const struct outbox_event *ev,
                               size_t *len);

/* As encode_envelope_json(), then each field of `fields` (may be NULL) as a
 * JSON string or null, after payload. */
int encode_envelope_json_fields(const struct outbox_event *ev, const struct encode_fields *fields,
                                struct buf *out) __attribute__((warn_unused_result));

/* One Kafka header; name and value point into an event or an encode_headers
 * scratch buffer. */
struct encode_header {
        const char *name;
        const char *value;
        size_t value_len;
};

/* headers_json may have at most ENCODE_MAX_HEADER_MEMBERS members (each
 * counts, also one that a fixed header or OUTBOX_ENVELOPE_FIELDS leaves out);
 * a row with more is refused (INVALID_HEADERS). Chosen above the 49-54 that
 * fitted before, so no row that was published is refused now. */
#define ENCODE_MAX_HEADER_MEMBERS 64
#define ENCODE_FIXED_HEADERS      15 /* event-id ... schema-id */
#define ENCODE_MAX_HEADERS        (ENCODE_FIXED_HEADERS + ENCODE_MAX_HEADER_MEMBERS)

/* Fills hdrs (capacity ENCODE_MAX_HEADERS) with the fixed headers, then each
 * headers_json member whose name is not a fixed header (at most
 * ENCODE_MAX_HEADER_MEMBERS members). `scratch` holds the
 * formatted numbers and member strings; hdrs point into it and into ev, so keep
 * both alive while hdrs is used. Returns the header count, or -1 when
 * ev->headers is NULL (headers_json is not an object) or malformed, or
 * ENCODE_NOMEM when memory ran out, with a reason in errstr. */
#define ENCODE_NOMEM (-2)
int encode_headers(const struct outbox_event *ev, const char *producer, const char *content_type,
                   const char *schema_id, struct encode_header *hdrs, struct buf *scratch,
                   char *errstr, size_t errstr_size) __attribute__((warn_unused_result));

/* As encode_headers(), leaving out what `fields` (may be NULL) places in the
 * envelope: those headers_json members, and event-key when event_key is placed. */
int encode_headers_fields(const struct outbox_event *ev, const char *producer,
                          const char *content_type, const char *schema_id,
                          const struct encode_fields *fields, struct encode_header *hdrs,
                          struct buf *scratch, char *errstr, size_t errstr_size)
        __attribute__((warn_unused_result));

#endif
