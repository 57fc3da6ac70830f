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
        M_DATABASE_UP,          /* gauge 0/1, both daemons */
        M_READY,                /* gauge 0/1, both daemons: what /readyz answers */
        M_KAFKA_BROKERS_UP,     /* gauge */
        M_LAST_LOCK_TIMESTAMP,  /* gauge, unix seconds */
        M_LAST_MARK_TIMESTAMP,  /* gauge, unix seconds */
        M_STALLED,              /* gauge 0/1 */
        M_STATEMENT_ERRORS,     /* counter, label statement */
        M_OLDEST_TXN_AGE,       /* gauge, seconds */
        M_OLDEST_DUE_AGE,       /* gauge, seconds */
        M_HELD_AGGREGATES,      /* gauge, label reason */
        M_EVENTS_HELD,          /* gauge */
        M_COUNT
};

/* Sets up the registry; `program` is outbox-relay or outbox-sweeper and goes
 * into outbox_build_info. 0 on success. */
int metrics_init(const char *program) __attribute__((warn_unused_result));

/* Counter: adds v (>= 0). Gauge: sets v. `label` is the value of the metric's
 * one label (topic, error_code, status) or NULL for unlabelled metrics. Label
 * values are bounded per metric (extra distinct values go to "other"). */
void metrics_add(enum metric_id id, const char *label, double v);
void metrics_set(enum metric_id id, const char *label, double v);

/* Histogram observation. */
void metrics_observe(enum metric_id id, double v);

/* A function metrics_render() calls first, from the thread that renders,
 * to bring gauges computed from the time up to date (NULL: none). */
void metrics_set_render_hook(void (*hook)(void *arg), void *arg);

/* Appends the Prometheus text exposition (version 0.0.4) to out. 0 on success. */
int metrics_render(struct buf *out) __attribute__((warn_unused_result));

/* Frees the registry. */
void metrics_destroy(void);

#endif
