/* kafka_stats.h - librdkafka's statistics (the JSON string its stats callback
 * gets every statistics.interval.ms; fields in librdkafka's STATISTICS.md)
 * reduced to the few numbers the relay exports, and exported. Parsing is a
 * pure function over outside input: any string gives a result or an error,
 * never a crash, and memory stays bounded whatever it holds. */
#ifndef OUTBOX_KAFKA_STATS_H
#define OUTBOX_KAFKA_STATS_H

#include <stddef.h>

/* Brokers kept per statistics (ordered by node id); later ones are left out
 * of the per-broker numbers (they still count in the totals). */
#define KAFKA_STATS_MAX_BROKERS 64

/* One broker with a node id (>= 0): bootstrap entries that have not learned
 * their id (nodeid -1), logical (coordinator) and internal brokers are left
 * out. Two entries with one node id are merged. */
struct kafka_stats_broker {
        int id;             /* node id */
        int up;             /* state is "UP" */
        double rtt_p99_s;   /* rtt.p99, microseconds -> seconds */
        long long inflight; /* waitresp_cnt: requests waiting for a response */
        long long outbuf;   /* outbuf_msg_cnt: messages waiting to be sent */
};

struct kafka_stats {
        size_t nbrokers;
        struct kafka_stats_broker brokers[KAFKA_STATS_MAX_BROKERS];
        long long brokers_up;     /* brokers with a node id whose state is "UP" */
        long long retries;        /* txretries of every broker entry, summed */
        long long errors;         /* txerrs + rxerrs + req_timeouts of every entry */
        long long queue_messages; /* msg_cnt: messages in the producer's queues */
};

/* Parses the statistics JSON (len bytes, need not be NUL-terminated) into
 * *out. Missing or malformed numbers read 0, negative ones 0, sums saturate.
 * 0 on success; -1 with errstr when it is not JSON or not an object. */
int kafka_stats_parse(const char *json, size_t len, struct kafka_stats *out, char *errstr,
                      size_t errstr_size) __attribute__((warn_unused_result));

/* What the exported counters have taken so far (zero-initialise; one per
 * producer's lifetime of statistics, kept by the caller). */
struct kafka_stats_seen {
        long long retries, errors;
};

/* Exports s: outbox_kafka_brokers_up, outbox_kafka_queue_messages, the
 * per-broker gauges (label broker = node id; brokers that left disappear),
 * and outbox_kafka_retries_total / outbox_kafka_errors_total, which grow by
 * what librdkafka's cumulative totals grew since *seen (from zero they equal
 * them). A total lower than before (a new producer, a broker gone) adds
 * nothing and becomes the new base. 0 on success. */
int kafka_stats_apply(const struct kafka_stats *s, struct kafka_stats_seen *seen)
        __attribute__((warn_unused_result));

#endif
