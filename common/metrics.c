/* metrics.c - the process's Prometheus metrics: one static table (as HAProxy's
 * promex) with docs/DESIGN.md's names, fixed-size storage, one mutex. */
#include "metrics.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef OUTBOX_VERSION
#define OUTBOX_VERSION "unknown"
#endif
#ifndef OUTBOX_SCHEMA_LEVEL
#define OUTBOX_SCHEMA_LEVEL "unknown"
#endif

/* Distinct label values kept per labelled metric, "other" included: the first
 * METRICS_MAX_SERIES - 1 values get their own series, later ones go to "other". */
#define METRICS_MAX_SERIES 64
/* Longer label values are cut (at a UTF-8 character boundary). */
#define METRICS_LABEL_MAX 256
#define METRICS_OTHER     "other"

enum metric_type { MT_COUNTER, MT_GAUGE, MT_HISTOGRAM, MT_INFO };

static const double latency_buckets[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                         0.5,   1,      2.5,   5,    10,    30,   60};
static const double batch_buckets[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                       0.5,   1,      2.5,   5,    10,    30,   60,  120};
/* 64 B .. 4 MiB, powers of 4. */
static const double size_buckets[] = {64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304};

#define NBUCKETS(a)         (sizeof(a) / sizeof((a)[0]))
#define METRICS_MAX_BUCKETS 16

/* Which daemon exposes a metric (outbox_build_info: both). */
enum { P_RELAY = 1, P_SWEEPER = 2, P_BOTH = P_RELAY | P_SWEEPER };

struct metric_def {
        const char *name;
        enum metric_type type;
        const char *help;
        const char *label;  /* NULL: unlabelled */
        const char *label2; /* second label, or NULL */
        const double *buckets;
        size_t nbuckets;
        int programs;               /* P_RELAY, P_SWEEPER or P_BOTH */
        const char *const *initial; /* label values shown at 0 before any update */
};

#define METRIC(id, t, n, p, l, l2, init, h)                                                        \
        [id] = {.name = n,                                                                         \
                .type = t,                                                                         \
                .help = h,                                                                         \
                .label = l,                                                                        \
                .label2 = l2,                                                                      \
                .programs = p,                                                                     \
                .initial = init}
#define COUNTER(id, n, l, h)      METRIC(id, MT_COUNTER, n, P_RELAY, l, NULL, NULL, h)
#define SWEEPER_COUNTER(id, n, h) METRIC(id, MT_COUNTER, n, P_SWEEPER, NULL, NULL, NULL, h)
#define GAUGE(id, n, l, h)        METRIC(id, MT_GAUGE, n, P_RELAY, l, NULL, NULL, h)
#define BOTH_GAUGE(id, n, h)      METRIC(id, MT_GAUGE, n, P_BOTH, NULL, NULL, NULL, h)
#define HISTOGRAM(id, n, b, h)                                                                     \
        [id] = {.name = n,                                                                         \
                .type = MT_HISTOGRAM,                                                              \
                .help = h,                                                                         \
                .buckets = b,                                                                      \
                .nbuckets = NBUCKETS(b),                                                           \
                .programs = P_RELAY}

/* Both reasons are exported from the start, so "no held aggregate" reads 0. */
static const char *const held_reasons[] = {"gap", "dead", NULL};

static const struct metric_def metric_defs[M_COUNT] = {
        COUNTER(M_EVENTS_PUBLISHED, "outbox_events_published_total", "topic",
                "Outbox events acknowledged by the broker and marked published."),
        COUNTER(M_EVENTS_FAILED, "outbox_events_failed_total", "error_code",
                "Outbox event delivery attempts that failed (will be retried)."),
        COUNTER(M_EVENTS_DEAD, "outbox_events_dead_total", "error_code",
                "Outbox events moved to DEAD (permanent error or attempts exhausted)."),
        COUNTER(M_LOCK_LOST, "outbox_lock_lost_total", NULL,
                "Rows whose lock was taken back (stale-lock reset) before the relay marked them."),
        COUNTER(M_BATCHES, "outbox_batches_total", NULL,
                "Batches of outbox rows locked and processed."),
        HISTOGRAM(M_PUBLISH_LATENCY, "outbox_publish_latency_seconds", latency_buckets,
                  "Time from an event's occurred_at to its broker acknowledgement."),
        HISTOGRAM(M_BATCH_DURATION, "outbox_batch_duration_seconds", batch_buckets,
                  "Time to lock, publish and mark one batch."),
        HISTOGRAM(M_EVENT_SIZE, "outbox_event_size_bytes", size_buckets,
                  "Size of the Kafka message value produced for an event."),
        GAUGE(M_EVENTS, "outbox_events", "status",
              "Outbox rows by status, sampled from the table."),
        GAUGE(M_OLDEST_PENDING_AGE, "outbox_oldest_pending_age_seconds", NULL,
              "Age of the oldest pending outbox row."),
        GAUGE(M_VERSION_GAPS, "outbox_version_gaps", NULL,
              "Aggregates whose next version waits for a missing version (a gap), sampled."),
        GAUGE(M_VERSION_GAP_AGE, "outbox_version_gap_age_seconds", NULL,
              "How long the longest-held version gap has held its aggregate."),
        GAUGE(M_LAST_BATCH_TIMESTAMP, "outbox_relay_last_batch_timestamp_seconds", NULL,
              "Unix time of the relay main loop's last turn (heartbeat, also when idle)."),
        SWEEPER_COUNTER(M_SWEEPER_STALE_RESET, "outbox_sweeper_stale_locks_reset_total",
                        "Stale row locks reset by the sweeper."),
        SWEEPER_COUNTER(M_SWEEPER_DELETED, "outbox_sweeper_rows_deleted_total",
                        "PUBLISHED rows deleted by the sweeper after retention."),
        [M_BUILD_INFO] = {.name = "outbox_build_info",
                          .type = MT_INFO,
                          .help = "Build information; the value is always 1.",
                          .programs = P_BOTH},
        BOTH_GAUGE(M_DATABASE_UP, "outbox_database_up",
                   "1 while a database connection is up and its set-up statements succeeded."),
        BOTH_GAUGE(M_READY, "outbox_ready", "1 while /readyz answers 200 (every condition ok)."),
        METRIC(M_STATEMENT_ERRORS, MT_COUNTER, "outbox_statement_errors_total", P_BOTH, "statement",
               "sqlstate", NULL, "Statements that failed, by statement name and SQLSTATE."),
        GAUGE(M_KAFKA_BROKERS_UP, "outbox_kafka_brokers_up", NULL,
              "Kafka brokers whose connection is up."),
        GAUGE(M_LAST_LOCK_TIMESTAMP, "outbox_relay_last_lock_timestamp_seconds", NULL,
              "Unix time the last lock statement completed (with rows or none)."),
        GAUGE(M_LAST_MARK_TIMESTAMP, "outbox_relay_last_mark_timestamp_seconds", NULL,
              "Unix time the last mark statement completed."),
        GAUGE(M_RELAY_STALLED, "outbox_relay_stalled", NULL,
              "1 while no lock or mark statement has completed within the stall bound."),
        GAUGE(M_OLDEST_TRANSACTION_AGE, "outbox_oldest_transaction_age_seconds", NULL,
              "Age of the oldest open transaction on the server that holds rows back (0: none)."),
        GAUGE(M_OLDEST_DUE_AGE, "outbox_oldest_due_age_seconds", NULL,
              "Age of the oldest due row nothing holds back (PENDING or FAILED, due, not "
              "behind a gap or a DEAD version)."),
        METRIC(M_HELD_AGGREGATES, MT_GAUGE, "outbox_held_aggregates", P_RELAY, "reason", NULL,
               held_reasons,
               "Aggregates held back by a missing version (gap) or by a DEAD version (dead)."),
        GAUGE(M_EVENTS_HELD, "outbox_events_held", NULL,
              "Unpublished rows of held aggregates (behind a gap or a DEAD version)."),
        GAUGE(M_EVENTS_LOCKED_BY_OTHER, "outbox_relay_events_locked_by_other", NULL,
              "Rows in this relay's hands whose mark waits for another transaction's lock on "
              "the row, as the relay's last probe of them found (the later versions of their "
              "aggregates wait behind them, uncounted)."),
        GAUGE(M_KAFKA_BROKER_RTT_P99, "outbox_kafka_broker_rtt_p99_seconds", "broker",
              "librdkafka: 99th percentile of the request round trip to each broker (node id)."),
        GAUGE(M_KAFKA_BROKER_INFLIGHT, "outbox_kafka_broker_inflight_requests", "broker",
              "librdkafka: requests sent to each broker and waiting for a response."),
        GAUGE(M_KAFKA_BROKER_OUTBUF, "outbox_kafka_broker_outbuf_messages", "broker",
              "librdkafka: messages in requests waiting to be sent to each broker."),
        COUNTER(M_KAFKA_RETRIES, "outbox_kafka_retries_total", NULL,
                "librdkafka: requests sent to brokers again (txretries; the messages of a "
                "failed produce request are queued again, not counted here)."),
        COUNTER(M_KAFKA_ERRORS, "outbox_kafka_errors_total", NULL,
                "librdkafka: request transmit and receive errors and request timeouts."),
        GAUGE(M_KAFKA_QUEUE_MESSAGES, "outbox_kafka_queue_messages", NULL,
              "librdkafka: messages in the producer's queues (not yet acknowledged)."),
};

struct series {
        char label[2][METRICS_LABEL_MAX];
        double value;
};

struct metric_state {
        double value; /* unlabelled counter or gauge */
        size_t nseries;
        struct series *series; /* labelled: METRICS_MAX_SERIES entries */
        unsigned long long counts[METRICS_MAX_BUCKETS + 1]; /* per bucket, last: +Inf */
        unsigned long long count;
        double sum;
};

static pthread_mutex_t metrics_lock = PTHREAD_MUTEX_INITIALIZER;
static struct metric_state states[M_COUNT];
/* One block per labelled metric (published, failed, dead, events, statement
 * errors, held aggregates, three per-broker gauges); metrics_init fails if
 * the table grows more. */
#define METRICS_LABELLED 9
static struct series labelled_storage[METRICS_LABELLED][METRICS_MAX_SERIES];
static char program_name[64] = "unknown";
static int set_up; /* states[].series wired; metrics_init is optional */

static struct series *series_find(const struct metric_def *d, struct metric_state *st,
                                  const char *label1, const char *label2);

static void state_reset(void) {
        size_t next = 0;
        set_up = 1;
        memset(labelled_storage, 0, sizeof labelled_storage);
        for (size_t i = 0; i < M_COUNT; i++) {
                memset(&states[i], 0, sizeof states[i]);
                if (metric_defs[i].label && next < NBUCKETS(labelled_storage))
                        states[i].series = labelled_storage[next++];
                for (const char *const *v = metric_defs[i].initial; v && *v; v++)
                        (void)series_find(&metric_defs[i], &states[i], *v, NULL);
        }
}

int metrics_init(const char *program) {
        int rc = -1;
        pthread_mutex_lock(&metrics_lock);
        size_t labelled = 0;
        for (size_t i = 0; i < M_COUNT; i++) {
                const struct metric_def *d = &metric_defs[i];
                if (!d->name || (d->label && ++labelled > NBUCKETS(labelled_storage)) ||
                    (d->label2 && !d->label) || d->nbuckets > METRICS_MAX_BUCKETS)
                        goto out; /* table and storage disagree */
        }
        state_reset();
        snprintf(program_name, sizeof program_name, "%s",
                 program && *program ? program : "unknown");
        rc = 0;
out:
        pthread_mutex_unlock(&metrics_lock);
        return rc;
}

void metrics_destroy(void) {
        pthread_mutex_lock(&metrics_lock);
        state_reset();
        snprintf(program_name, sizeof program_name, "%s", "unknown");
        pthread_mutex_unlock(&metrics_lock);
}

/* `label` as stored: "other" when NULL or empty, cut to METRICS_LABEL_MAX - 1
 * bytes at a UTF-8 character boundary. */
static void label_copy(char out[METRICS_LABEL_MAX], const char *label) {
        if (!label || !*label)
                label = METRICS_OTHER;
        size_t n = strlen(label);
        if (n >= METRICS_LABEL_MAX) {
                n = METRICS_LABEL_MAX - 1;
                while (n > 0 && ((unsigned char)label[n] & 0xC0) == 0x80)
                        n--; /* do not split a UTF-8 sequence */
        }
        memcpy(out, label, n);
        out[n] = '\0';
}

static struct series *series_lookup(struct metric_state *st, const char *l1, const char *l2) {
        for (size_t i = 0; i < st->nseries; i++)
                if (strcmp(st->series[i].label[0], l1) == 0 &&
                    strcmp(st->series[i].label[1], l2) == 0)
                        return &st->series[i];
        return NULL;
}

/* The series for the label values (caller holds the lock), created at 0 when
 * new; never NULL for a labelled metric set up by state_reset. Past the bound
 * new values share the series whose every label reads "other". */
static struct series *series_find(const struct metric_def *d, struct metric_state *st,
                                  const char *label1, const char *label2) {
        if (!st->series)
                return NULL;
        char l1[METRICS_LABEL_MAX], l2[METRICS_LABEL_MAX] = "";
        label_copy(l1, label1);
        if (d->label2)
                label_copy(l2, label2);
        struct series *s = series_lookup(st, l1, l2);
        if (s)
                return s;
        /* The last slot is kept for "other". */
        if (st->nseries >= METRICS_MAX_SERIES - 1) {
                snprintf(l1, sizeof l1, "%s", METRICS_OTHER);
                if (d->label2)
                        snprintf(l2, sizeof l2, "%s", METRICS_OTHER);
                if ((s = series_lookup(st, l1, l2)))
                        return s;
        }
        if (st->nseries >= METRICS_MAX_SERIES)
                return NULL; /* only after metrics_replace filled every slot */
        s = &st->series[st->nseries++];
        memcpy(s->label[0], l1, sizeof l1);
        memcpy(s->label[1], l2, sizeof l2);
        s->value = 0;
        return s;
}

static double *value_slot(enum metric_id id, const char *label1, const char *label2) {
        if (!set_up)
                state_reset();
        struct metric_state *st = &states[id];
        if (!metric_defs[id].label)
                return &st->value;
        struct series *s = series_find(&metric_defs[id], st, label1, label2);
        return s ? &s->value : NULL;
}

void metrics_add2(enum metric_id id, const char *label1, const char *label2, double v) {
        if ((unsigned)id >= M_COUNT || isnan(v))
                return;
        enum metric_type t = metric_defs[id].type;
        if (t != MT_COUNTER && t != MT_GAUGE)
                return;
        if (t == MT_COUNTER && v < 0)
                return; /* counters never go down */
        pthread_mutex_lock(&metrics_lock);
        double *slot = value_slot(id, label1, label2);
        if (slot)
                *slot += v;
        pthread_mutex_unlock(&metrics_lock);
}

void metrics_set2(enum metric_id id, const char *label1, const char *label2, double v) {
        if ((unsigned)id >= M_COUNT || isnan(v))
                return;
        enum metric_type t = metric_defs[id].type;
        if (t != MT_COUNTER && t != MT_GAUGE)
                return;
        pthread_mutex_lock(&metrics_lock);
        double *slot = value_slot(id, label1, label2);
        /* A counter may be set (mirroring a cumulative count) but never lowered. */
        if (slot && (t == MT_GAUGE || v >= *slot))
                *slot = v;
        pthread_mutex_unlock(&metrics_lock);
}

void metrics_add(enum metric_id id, const char *label, double v) {
        metrics_add2(id, label, NULL, v);
}

void metrics_set(enum metric_id id, const char *label, double v) {
        metrics_set2(id, label, NULL, v);
}

int metrics_replace(enum metric_id id, size_t n, const char *const labels[],
                    const double values[]) {
        if ((unsigned)id >= M_COUNT || metric_defs[id].type != MT_GAUGE || !metric_defs[id].label ||
            metric_defs[id].label2 || (n && (!labels || !values)))
                return -1;
        pthread_mutex_lock(&metrics_lock);
        if (!set_up)
                state_reset();
        struct metric_state *st = &states[id];
        st->nseries = 0;
        for (size_t i = 0; i < n && st->nseries < METRICS_MAX_SERIES; i++) {
                if (isnan(values[i]))
                        continue;
                char l[METRICS_LABEL_MAX];
                label_copy(l, labels[i]);
                struct series *s = series_lookup(st, l, "");
                if (!s) {
                        s = &st->series[st->nseries++];
                        memcpy(s->label[0], l, sizeof l);
                        s->label[1][0] = '\0';
                }
                s->value = values[i];
        }
        pthread_mutex_unlock(&metrics_lock);
        return 0;
}

void metrics_observe(enum metric_id id, double v) {
        if ((unsigned)id >= M_COUNT || metric_defs[id].type != MT_HISTOGRAM || isnan(v))
                return;
        const struct metric_def *d = &metric_defs[id];
        size_t b = 0;
        while (b < d->nbuckets && v > d->buckets[b])
                b++; /* b == nbuckets: only +Inf */
        pthread_mutex_lock(&metrics_lock);
        if (!set_up)
                state_reset();
        struct metric_state *st = &states[id];
        st->counts[b]++;
        st->count++;
        st->sum += v;
        pthread_mutex_unlock(&metrics_lock);
}

/* Formats v as Prometheus parses it: integers without a fraction, otherwise
 * the shortest of %.15g / %.17g that reads back exactly. */
static void format_number(char *out, size_t size, double v) {
        if (isnan(v)) {
                snprintf(out, size, "NaN");
        } else if (isinf(v)) {
                snprintf(out, size, v > 0 ? "+Inf" : "-Inf");
        } else if (v == floor(v) && fabs(v) < 9007199254740992.0) {
                snprintf(out, size, "%.0f", v == 0 ? 0.0 : v); /* no "-0" */
        } else {
                snprintf(out, size, "%.15g", v);
                if (strtod(out, NULL) != v)
                        snprintf(out, size, "%.17g", v);
        }
}

/* Appends s with the exposition format's escapes: backslash and newline, plus
 * the double quote inside label values. */
static int append_escaped(struct buf *out, const char *s, int quote) {
        const char *run = s;
        for (const char *p = s; *p; p++) {
                const char *esc = NULL;
                if (*p == '\\')
                        esc = "\\\\";
                else if (*p == '\n')
                        esc = "\\n";
                else if (quote && *p == '"')
                        esc = "\\\"";
                if (!esc)
                        continue;
                if (buf_append(out, run, (size_t)(p - run)) != 0 || buf_append(out, esc, 2) != 0)
                        return -1;
                run = p + 1;
        }
        return buf_append(out, run, strlen(run));
}

/* One sample line; labels[i] = label_values[i] for the non-NULL names (at
 * most two). */
static int render_sample(struct buf *out, const char *name, const char *suffix,
                         const char *const labels[2], const char *const label_values[2], double v) {
        char num[64];
        format_number(num, sizeof num, v);
        if (buf_appendf(out, "%s%s", name, suffix) != 0)
                return -1;
        for (int i = 0; i < 2 && labels && labels[i]; i++) {
                if (buf_appendf(out, "%s%s=\"", i ? "," : "{", labels[i]) != 0 ||
                    append_escaped(out, label_values[i], 1) != 0 || buf_append(out, "\"", 1) != 0)
                        return -1;
        }
        if (labels && labels[0] && buf_append(out, "}", 1) != 0)
                return -1;
        return buf_appendf(out, " %s\n", num);
}

static int render_histogram(struct buf *out, const struct metric_def *d,
                            const struct metric_state *st) {
        unsigned long long cum = 0;
        char le[64];
        for (size_t b = 0; b <= d->nbuckets; b++) {
                cum += st->counts[b];
                if (b < d->nbuckets)
                        format_number(le, sizeof le, d->buckets[b]);
                else
                        snprintf(le, sizeof le, "+Inf");
                const char *const names[2] = {"le", NULL}, *const values[2] = {le, NULL};
                if (render_sample(out, d->name, "_bucket", names, values, (double)cum) != 0)
                        return -1;
        }
        if (render_sample(out, d->name, "_sum", NULL, NULL, st->sum) != 0 ||
            render_sample(out, d->name, "_count", NULL, NULL, (double)st->count) != 0)
                return -1;
        return 0;
}

static int render_metric(struct buf *out, enum metric_id id) {
        static const char *const type_names[] = {
                [MT_COUNTER] = "counter",
                [MT_GAUGE] = "gauge",
                [MT_HISTOGRAM] = "histogram",
                [MT_INFO] = "gauge",
        };
        const struct metric_def *d = &metric_defs[id];
        const struct metric_state *st = &states[id];

        if (buf_appendf(out, "# HELP %s ", d->name) != 0 || append_escaped(out, d->help, 0) != 0 ||
            buf_appendf(out, "\n# TYPE %s %s\n", d->name, type_names[d->type]) != 0)
                return -1;
        switch (d->type) {
        case MT_HISTOGRAM: return render_histogram(out, d, st);
        case MT_INFO:
                if (buf_appendf(out, "%s{version=\"", d->name) != 0 ||
                    append_escaped(out, OUTBOX_VERSION, 1) != 0 ||
                    buf_append(out, "\",schema=\"", 10) != 0 ||
                    append_escaped(out, OUTBOX_SCHEMA_LEVEL, 1) != 0 ||
                    buf_append(out, "\",program=\"", 11) != 0 ||
                    append_escaped(out, program_name, 1) != 0 || buf_append(out, "\"} 1\n", 5) != 0)
                        return -1;
                return 0;
        case MT_COUNTER:
        case MT_GAUGE:
                if (!d->label)
                        return render_sample(out, d->name, "", NULL, NULL, st->value);
                for (size_t i = 0; i < st->nseries; i++) {
                        const char *const names[2] = {d->label, d->label2};
                        const char *const values[2] = {st->series[i].label[0],
                                                       st->series[i].label[1]};
                        if (render_sample(out, d->name, "", names, values, st->series[i].value) !=
                            0)
                                return -1;
                }
                return 0;
        }
        return -1;
}

static void (*render_hook)(void *);
static void *render_hook_arg;

void metrics_set_render_hook(void (*hook)(void *arg), void *arg) {
        render_hook = hook;
        render_hook_arg = arg;
}

int metrics_render(struct buf *out) {
        if (render_hook)
                render_hook(render_hook_arg);
        int rc = -1;
        size_t start = out->len;
        pthread_mutex_lock(&metrics_lock);
        if (!set_up)
                state_reset();
        /* Each daemon exposes its own metrics only: a sweeper's never-set
         * relay heartbeat would read as a relay stalled since 1970. Before
         * metrics_init (unit tests) everything is shown. */
        int program = strcmp(program_name, "outbox-sweeper") == 0 ? P_SWEEPER
                      : strcmp(program_name, "outbox-relay") == 0 ? P_RELAY
                                                                  : P_BOTH;
        for (size_t i = 0; i < M_COUNT; i++) {
                if (!(metric_defs[i].programs & program))
                        continue;
                if (render_metric(out, (enum metric_id)i) != 0)
                        goto out;
        }
        rc = 0;
out:
        pthread_mutex_unlock(&metrics_lock);
        if (rc != 0 && out->data) {
                out->len = start; /* no half-rendered exposition */
                out->data[start] = '\0';
        }
        return rc;
}
