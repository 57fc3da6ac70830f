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

/* Called from kafka_poll()/kafka_wait() in the caller's thread, once per
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

/* Creates the producer. NULL on failure (errstr says why). */
struct kafka *kafka_new(const struct config *cfg, kafka_delivery_cb *cb, void *ctx, char *errstr,
                        size_t errstr_size);

/* Queues one message (copies key, value and headers). Returns 0, or -1 with
 * *res filled (the message was not queued and no callback will come).
 * A full local queue is waited out here by polling. */
int kafka_produce(struct kafka *k, const char *topic, const char *key, size_t key_len,
                  const void *value, size_t value_len, const struct encode_header *hdrs,
                  int hdr_cnt, void *opaque, struct kafka_result *res)
        __attribute__((warn_unused_result));

/* Serves delivery callbacks for up to timeout_ms. */
void kafka_poll(struct kafka *k, int timeout_ms);

/* Waits until every queued message has had its callback, or timeout_ms.
 * Messages still outstanding then are purged, and their callbacks (with
 * _PURGE_QUEUE / _PURGE_INFLIGHT, retriable) are served before returning,
 * so no callback for them comes later. With `tick`, it is called about every
 * KAFKA_TICK_MS meanwhile (e.g. to read another connection's input) until it
 * returns 0. */
#define KAFKA_TICK_MS 10
void kafka_wait(struct kafka *k, int timeout_ms, int (*tick)(void *), void *arg);

/* Messages not yet reported. */
int kafka_outstanding(struct kafka *k);

/* Nonzero once the producer hit a fatal error (idempotence state lost); the
 * reason goes into errstr. The producer must then be rebuilt. */
int kafka_fatal(struct kafka *k, char *errstr, size_t errstr_size);

/* Nonzero while at least one broker connection is up. */
int kafka_broker_up(struct kafka *k);

/* The delivery timeout (ms) in effect. */
int kafka_delivery_timeout_ms(const struct kafka *k);

/* Purges anything left and destroys the producer. NULL is a no-op. */
void kafka_destroy(struct kafka *k);

#endif
