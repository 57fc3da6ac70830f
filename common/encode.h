/* encode.h - what a row becomes on Kafka: topic, key, JSON value, headers.
 * Pure functions over struct outbox_event; no I/O. */
#ifndef OUTBOX_ENCODE_H
#define OUTBOX_ENCODE_H

#include <stddef.h>

#include "event.h"

/* A growable byte buffer. Zero-initialise; buf_free() releases. */
struct buf {
        char *data;
        size_t len, cap;
};

int buf_append(struct buf *b, const void *p, size_t n) __attribute__((warn_unused_result));
int buf_appendf(struct buf *b, const char *fmt, ...)
        __attribute__((format(printf, 2, 3), warn_unused_result));
/* Appends s as a JSON string literal (quotes included), or null when s is NULL. */
int buf_append_json_string(struct buf *b, const char *s) __attribute__((warn_unused_result));
void buf_reset(struct buf *b);
void buf_free(struct buf *b);

/* Writes the topic: ev->topic_name, else `template` with {aggregate_type},
 * {event_type} and {tenant_id} replaced. 0 on success. */
int encode_topic(const char *template, const struct outbox_event *ev, struct buf *out)
        __attribute__((warn_unused_result));

/* Writes the DESIGN.md JSON envelope (every key present, null where NULL, the
 * payload JSON embedded as is). 0 on success. */
int encode_envelope_json(const struct outbox_event *ev, struct buf *out)
        __attribute__((warn_unused_result));

/* One Kafka header; name and value point into an event or an encode_headers
 * scratch buffer. */
struct encode_header {
        const char *name;
        const char *value;
        size_t value_len;
};

#define ENCODE_MAX_HEADERS 64

/* Fills hdrs (capacity ENCODE_MAX_HEADERS) with the fixed headers, then each
 * headers_json member whose name is not a fixed header. `scratch` holds the
 * formatted numbers and member strings; hdrs point into it and into ev, so keep
 * both alive while hdrs is used. Returns the header count, or -1 when
 * ev->headers is NULL (headers_json is not an object) or malformed, with a
 * reason in errstr. */
int encode_headers(const struct outbox_event *ev, const char *producer,
                   const char *content_type, const char *schema_id,
                   struct encode_header *hdrs, struct buf *scratch, char *errstr,
                   size_t errstr_size) __attribute__((warn_unused_result));

#endif
