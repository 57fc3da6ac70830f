/* kafka_read.h - reading what Kafka holds for a time window (outboxctl
 * reconcile): the messages of every partition of some topics whose
 * timestamps are in the window, between the offsets Kafka's
 * offsets-for-times gives for its ends (or the whole partition, when the
 * broker cannot look offsets up by time), one message at a time. Part of the
 * kafka module (the only one that includes rdkafka.h); no consumer group,
 * nothing committed. */
#ifndef OUTBOX_KAFKA_READ_H
#define OUTBOX_KAFKA_READ_H

#include <stddef.h>

#include "config.h"

struct kafka_reader;

/* One message. Pointers are valid until the next kafka_reader_next() call;
 * header values are bytes (not NUL-terminated), NULL when the header is
 * absent. */
struct kafka_read_msg {
        const char *topic;
        int partition;
        long long offset, timestamp_ms;
        const char *event_id, *tenant_id, *aggregate_type, *aggregate_id, *aggregate_version;
        size_t event_id_len, tenant_id_len, aggregate_type_len, aggregate_id_len,
                aggregate_version_len;
};

/* A consumer (not connected yet) with cfg's librdkafka properties
 * (OUTBOX_KAFKA_*: bootstrap.servers, security), client.id outboxctl unless
 * set, and at most queued_kbytes of messages fetched ahead. NULL with errstr
 * set on bad configuration. */
struct kafka_reader *kafka_reader_new(const struct config *cfg, int queued_kbytes, char *errstr,
                                      size_t errstr_size);

/* Plans the read: for each of the n topics, every partition from the first
 * message whose timestamp is >= from_ms up to (not including) the first
 * whose timestamp is >= to_ms, or up to the end (the high watermark now)
 * when none is. A partition whose offsets the broker cannot look up by time
 * (offsets-for-times fails, or answers -1 for timestamp 0 while the
 * partition holds messages, as librdkafka's mock cluster does) is scanned
 * instead: read from its low watermark, keeping the messages whose
 * timestamps are in [from_ms, to_ms). A partition that cannot be read at all
 * is recorded (kafka_reader_partition()), not an error. A topic the cluster
 * does not have is left out (kafka_reader_topic_found() says so). 0, or -1
 * with errstr (no broker answered within timeout_ms). Topic names are
 * copied. */
int kafka_reader_plan(struct kafka_reader *r, const char *const *topics, size_t n,
                      long long from_ms, long long to_ms, int timeout_ms, char *errstr,
                      size_t errstr_size) __attribute__((warn_unused_result));

/* Nonzero when topic i of the plan exists. */
int kafka_reader_topic_found(const struct kafka_reader *r, size_t i);

/* Partitions and messages (by offsets) the plan covers, and how many
 * messages were read so far. */
void kafka_reader_progress(const struct kafka_reader *r, int *partitions, long long *planned,
                           long long *read);

/* One partition of the plan: how it was read, or why it was not. Pointers
 * are valid until kafka_reader_destroy(). */
struct kafka_read_part {
        const char *topic;
        int partition;
        int scanned;        /* read from its start, filtered by timestamp */
        const char *unread; /* why it could not be read (nothing for idle_ms, an
                             * error), or NULL */
};

/* The partitions of the plan, and partition i of them. */
size_t kafka_reader_partitions(const struct kafka_reader *r);
void kafka_reader_partition(const struct kafka_reader *r, size_t i, struct kafka_read_part *out);

/* The next message in (topic, partition, offset) order: 1 and *m filled, 0
 * when every planned partition is read or given up (a partition that gives
 * nothing for idle_ms, or an error, is recorded as unread and the next one
 * read). Partitions are read one at a time, so at most one partition's
 * fetched-ahead messages are held. */
int kafka_reader_next(struct kafka_reader *r, struct kafka_read_msg *m, int idle_ms)
        __attribute__((warn_unused_result));

/* Stops and frees. NULL is a no-op. */
void kafka_reader_destroy(struct kafka_reader *r);

#endif
