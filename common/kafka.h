/* kafka.h - the idempotent producer. The only module that includes rdkafka.h. */
#ifndef OUTBOX_KAFKA_H
#define OUTBOX_KAFKA_H

#include <stddef.h>

#include "config.h"
#include "encode.h"

struct kafka;

/* The outcome of one message, given to the delivery callback. */
struct kafka_result {
        int ok;              /* acknowledged by the broker */
        int permanent;       /* a retry cannot succeed (docs/DESIGN.md step 4) */
        const char *code;    /* rd_kafka_err2name(), e.g. _MSG_TIMED_OUT; static */
        const char *message; /* human text; valid during the callback only */
};

/* Called from kafka_serve() in the caller's thread, once per
 * produced message, with the opaque given to kafka_produce(). */
typedef void(kafka_delivery_cb)(void *opaque, const struct kafka_result *res, void *ctx);

/* Builds and checks the producer configuration (defaults of docs/DESIGN.md, then
 * cfg->kafka). Does not connect. Returns 0, or -1 with errstr naming the
 * variable (bad or unknown property, idempotence turned off). */
int kafka_conf_check(const struct config *cfg, char *errstr, size_t errstr_size)
        __attribute__((warn_unused_result));

/* The effective value of librdkafka property `name` (defaults, the relay's
 * own defaults and cfg's properties applied) into out. 0, or -1 with errstr
 * set (bad configuration, unknown property, out too small). */
int kafka_conf_get(const struct config *cfg, const char *name, char *out, size_t out_size,
                   char *errstr, size_t errstr_size) __attribute__((warn_unused_result));

/* Called from kafka_serve() with librdkafka's statistics JSON (valid during
 * the call only). */
typedef void(kafka_stats_cb)(const char *json, size_t len, void *ctx);

/* Creates the producer; it connects in the background (nothing here
 * waits). `stats` may be NULL. NULL on failure (errstr says why). */
struct kafka *kafka_new(const struct config *cfg, kafka_delivery_cb *cb, kafka_stats_cb *stats,
                        void *ctx, char *errstr, size_t errstr_size);

/* A descriptor that turns readable when delivery reports, errors or
 * statistics wait: poll it, then call kafka_serve(). */
int kafka_fd(const struct kafka *k);

/* Serves what waits (the callbacks run here, in the caller's thread);
 * never blocks. */
void kafka_serve(struct kafka *k);

/* Queues one message (copies key, value and headers); never blocks.
 * Returns 0; KAFKA_FULL when the producer's queue is full (try again after
 * some delivery reports: nothing was queued); or -1 with *res filled (the
 * message was not queued and no callback will come). */
#define KAFKA_FULL 1
int kafka_produce(struct kafka *k, const char *topic, const char *key, size_t key_len,
                  const void *value, size_t value_len, const struct encode_header *hdrs,
                  int hdr_cnt, void *opaque, struct kafka_result *res)
        __attribute__((warn_unused_result));

/* Purges every queued and in-flight message: their callbacks come from
 * kafka_serve(), with _PURGE_QUEUE / _PURGE_INFLIGHT (retriable). */
void kafka_purge(struct kafka *k);

/* Messages not yet reported. */
int kafka_outstanding(const struct kafka *k);

/* Nonzero once the producer hit a fatal error (idempotence state lost); the
 * reason goes into errstr. The producer must then be rebuilt. */
int kafka_fatal(struct kafka *k, char *errstr, size_t errstr_size);

/* Nonzero when a broker was reached since every broker was last reported
 * down (a delivery succeeded, or the statistics counted a broker up). */
int kafka_broker_up(const struct kafka *k);
void kafka_set_broker_up(struct kafka *k, int up);

/* The delivery timeout (ms) and message.max.bytes in effect. */
int kafka_delivery_timeout_ms(const struct kafka *k);
long long kafka_max_message_bytes(const struct kafka *k);

/* Purges anything left and destroys the producer. NULL is a no-op. */
void kafka_destroy(struct kafka *k);

#endif
