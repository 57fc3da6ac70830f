/* metrics.h - the process's Prometheus metrics, declared in one static table
 * (metrics.c) with docs/DESIGN.md's names. Thread-safe: the main loop updates, the
 * HTTP thread renders. */
#ifndef OUTBOX_METRICS_H
#define OUTBOX_METRICS_H

#include "encode.h"

enum metric_id {
        M_EVENTS_PUBLISHED,     /* counter, label topic */
        M_EVENTS_FAILED,        /* counter, label error_code */
        M_EVENTS_DEAD,          /* counter, label error_code */
        M_LOCK_LOST,            /* counter */
        M_BATCHES,              /* counter */
        M_PUBLISH_LATENCY,      /* histogram, seconds */
        M_BATCH_DURATION,       /* histogram, seconds */
        M_EVENT_SIZE,           /* histogram, bytes */
        M_EVENTS,               /* gauge, label status */
        M_OLDEST_PENDING_AGE,   /* gauge, seconds */
        M_VERSION_GAPS,         /* gauge */
        M_VERSION_GAP_AGE,      /* gauge, seconds */
        M_LAST_BATCH_TIMESTAMP, /* gauge, unix seconds */
        M_SWEEPER_STALE_RESET,  /* counter */
        M_SWEEPER_DELETED,      /* counter */
        M_BUILD_INFO,           /* gauge 1, labels version, program */
        /* Readiness and its conditions (/readyz), both daemons unless said. */
        M_DATABASE_UP,            /* gauge 0/1 */
        M_READY,                  /* gauge 0/1: what /readyz answers */
        M_STATEMENT_ERRORS,       /* counter, labels statement, sqlstate */
        M_KAFKA_BROKERS_UP,       /* gauge (relay) */
        M_LAST_LOCK_TIMESTAMP,    /* gauge, unix seconds (relay) */
        M_LAST_MARK_TIMESTAMP,    /* gauge, unix seconds (relay) */
        M_RELAY_STALLED,          /* gauge 0/1 (relay) */
        M_OLDEST_TRANSACTION_AGE, /* gauge, seconds (relay) */
        M_OLDEST_DUE_AGE,         /* gauge, seconds (relay) */
        M_HELD_AGGREGATES,        /* gauge, label reason: gap | dead (relay) */
        M_EVENTS_HELD,            /* gauge (relay) */
        M_EVENTS_LOCKED_BY_OTHER, /* gauge (relay) */
        /* librdkafka statistics (relay; kafka_stats.h) */
        M_KAFKA_BROKER_RTT_P99,  /* gauge, seconds, label broker (node id) */
        M_KAFKA_BROKER_INFLIGHT, /* gauge, label broker */
        M_KAFKA_BROKER_OUTBUF,   /* gauge, label broker */
        M_KAFKA_RETRIES,         /* counter */
        M_KAFKA_ERRORS,          /* counter */
        M_KAFKA_QUEUE_MESSAGES,  /* gauge */
        M_COUNT
};

/* Sets up the registry; `program` is outbox-relay or outbox-sweeper and goes
 * into outbox_build_info. 0 on success. */
int metrics_init(const char *program) __attribute__((warn_unused_result));

/* metrics_add: a counter or gauge grows by v (a counter only by v >= 0).
 * metrics_set: a gauge takes v; a counter takes v only if it is not lower
 * (mirroring a cumulative count). `label` is the value of the metric's one
 * label (topic, error_code, status, reason, broker) or NULL for unlabelled
 * metrics. Label values are bounded per metric (extra distinct values go to
 * "other"). */
void metrics_add(enum metric_id id, const char *label, double v);
void metrics_set(enum metric_id id, const char *label, double v);

/* The same for a metric with two labels (outbox_statement_errors_total:
 * statement, sqlstate); each NULL or empty value reads "other". */
void metrics_add2(enum metric_id id, const char *label1, const char *label2, double v);
void metrics_set2(enum metric_id id, const char *label1, const char *label2, double v);

/* Replaces every series of a one-label gauge at once with the n given ones
 * (labels[i] -> values[i]), so a render never sees half of an update and a
 * label value that is gone (a broker that left) stops being exported. At most
 * the metric's bound is kept. 0 on success, -1 if id is not a one-label
 * gauge. */
int metrics_replace(enum metric_id id, size_t n, const char *const labels[], const double values[])
        __attribute__((warn_unused_result));

/* A function metrics_render() calls first, from the thread that renders,
 * to bring gauges computed from the time up to date (NULL: none). Set it
 * while nothing renders (before serving, after stopping). */
void metrics_set_render_hook(void (*hook)(void *arg), void *arg);

/* Histogram observation. */
void metrics_observe(enum metric_id id, double v);

/* Appends the Prometheus text exposition (version 0.0.4) to out. 0 on success. */
int metrics_render(struct buf *out) __attribute__((warn_unused_result));

/* Frees the registry. */
void metrics_destroy(void);

#endif
