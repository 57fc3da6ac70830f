/* message.h - what a row becomes on Kafka: topic, key, value (the JSON
 * envelope, the payload alone, or Avro, with or without a schema registry)
 * and headers (docs/DESIGN.md, "Kafka message"). One object serves every
 * row; it keeps the buffers the current message lives in. */
#ifndef OUTBOX_MESSAGE_H
#define OUTBOX_MESSAGE_H

#include <stddef.h>

#include "config.h"
#include "encode.h"
#include "event.h"

struct message;

/* One row as a Kafka message. Points into the row and into the message
 * object: valid until the next message_build() or message_destroy(). */
struct message_parts {
        const char *topic;
        const char *key;
        size_t key_len;
        const void *value; /* NULL: a tombstone */
        size_t value_len;
        const struct encode_header *headers;
        int header_count;
};

/* Why a row could not become a message. */
struct message_error {
        const char *code; /* ENCODE_FAILED, INVALID_HEADERS, INVALID_VALUE,
                           * OUT_OF_MEMORY, REGISTRY_UNAVAILABLE or
                           * REGISTRY_REJECTED; static */
        int permanent;    /* no retry can succeed: the row goes DEAD at once */
        int uncounted;    /* the attempt does not count: the registry could not answer,
                           * which says nothing about the row */
        char text[160];   /* human text, never a payload */
};

/* Builds the encoder for `cfg` (topic template, value format, serialization,
 * envelope fields, schema registry, producer name), which is borrowed and
 * must outlive it. Nothing connects yet. NULL on failure (errstr says why). */
struct message *message_new(const struct config *cfg, char *errstr, size_t errstr_size);

/* Frees everything. NULL is a no-op. */
void message_destroy(struct message *m);

/* Makes ev a Kafka message: 0 with *out filled, or -1 with *why. out->topic is
 * set whenever the topic could be formed, on failure too. */
int message_build(struct message *m, const struct outbox_event *ev, struct message_parts *out,
                  struct message_error *why) __attribute__((warn_unused_result));

/* Nonzero when values are Avro; then *fingerprint gets the value schema's
 * CRC-64-AVRO fingerprint and *registry whether a schema registry is used. */
int message_avro(const struct message *m, unsigned long long *fingerprint, int *registry);

#endif
