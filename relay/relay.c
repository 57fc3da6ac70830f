/* relay.c - lock -> produce -> wait for delivery reports -> mark. */
#include "relay.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "avroenc.h"
#include "clock.h"
#include "db.h"
#include "encode.h"
#include "kafka.h"
#include "lifecycle.h"
#include "log.h"
#include "metrics.h"
#include "registry.h"

#define SAMPLE_INTERVAL_S 10.0
/* The table sample counts every unpublished row: with a large backlog it
 * takes long, and the loop waits for it. The next sample waits at least this
 * many times as long as the last one took, so sampling keeps to about 2 % of
 * the relay's time however large the backlog. */
#define SAMPLE_SPACING 50.0
/* After a stop request, how long marking may keep retrying a lost database. */
#define STOP_MARK_GRACE_S 30.0
/* A batch locked ahead (while the one before it was published) goes out only
 * if its lock is at most this old; older (the batch before it waited for a
 * broker), it is released unproduced and locked again later, so no lock lives
 * much longer than one batch's delivery timeout (which OUTBOX_LOCK_TIMEOUT_S
 * must outlast). */
#define AHEAD_MAX_AGE_S 5.0
/* After a lock ahead found nothing, how long not to try again. */
#define AHEAD_PAUSE_S 1.0

/* What happened to one row of the batch. */
struct row_state {
        int done; /* outcome known (delivery report or produce error) */
        int ok;
        int permanent;
        int released;     /* never produced: goes back unattempted (DB_RELEASED) */
        int wave;         /* position in its aggregate's run of versions in the batch */
        const char *code; /* static: rd_kafka_err2name() or our own codes */
        char message[160];
        char *topic;
        size_t size;
};

struct relay {
        const struct config *cfg;
        struct http *http;
        struct db *db;
        struct kafka *kafka;
        unsigned seed;
        struct db_batch batch;
        /* the next batch, locked while `batch` was being published (none
         * while next.count is 0) */
        struct db_batch next;
        double next_locked_at; /* when its lock statement was sent */
        double ahead_after;    /* no lock ahead before this (monotonic) */
        struct row_state *rows;
        struct db_outcome *outs;
        struct buf topic, value, scratch;
        struct encode_header hdrs[ENCODE_MAX_HEADERS];
        /* the value serializer: OUTBOX_ENVELOPE_FIELDS, and for avro the
         * encoder and (with OUTBOX_SCHEMA_REGISTRY_URL) the registry client */
        struct encode_fields fields;
        struct avroenc *avro;
        struct registry *registry;
        struct buf subject;
        double next_sample; /* no table sample before this (monotonic) */
        int sample_slow;    /* the last sample stretched the interval */
        int reconnect_ms;
        long seen_connects;   /* db_connects() when own locks were last checked */
        int unmarked;         /* a batch could not be marked before stopping */
        double stop_deadline; /* set at the first stop-time retry: when to give up */
};

long long relay_backoff_ms(int attempt, int initial_ms, int max_ms, unsigned *seed) {
        long long d = initial_ms;
        for (int i = 1; i < attempt && d < max_ms; i++)
                d *= 2;
        if (d > max_ms)
                d = max_ms;
        long long half = d / 2;
        return half + (d - half > 0 ? (long long)(rand_r(seed) % (d - half + 1)) : 0);
}

static void on_delivery(void *opaque, const struct kafka_result *res, void *ctx) {
        struct row_state *st = opaque;
        (void)ctx;
        st->done = 1;
        st->ok = res->ok;
        st->permanent = res->permanent;
        st->code = res->code;
        if (res->ok)
                return; /* an acknowledged row's outcome carries no message */
        snprintf(st->message, sizeof st->message, "%s", res->message);
        encode_utf8_clean(st->message);
}

struct relay *relay_new(const struct config *cfg, struct http *http, char *errstr,
                        size_t errstr_size) {
        struct relay *r = calloc(1, sizeof *r);
        if (!r) {
                snprintf(errstr, errstr_size, "out of memory");
                return NULL;
        }
        r->cfg = cfg;
        r->http = http;
        r->seed = (unsigned)time(NULL) ^ (unsigned)getpid();
        r->reconnect_ms = LIFECYCLE_RECONNECT_MIN_MS;
        r->rows = calloc((size_t)cfg->batch_size, sizeof *r->rows);
        r->outs = calloc((size_t)cfg->batch_size, sizeof *r->outs);
        r->db = db_new(cfg->database_url, cfg->table, cfg->relay_id);
        if (!r->rows || !r->outs || !r->db) {
                snprintf(errstr, errstr_size, "out of memory");
                goto fail;
        }
        if (encode_fields_parse(cfg->envelope_fields, &r->fields, errstr, errstr_size) != 0)
                goto fail;
        if (cfg->serialization == SERIALIZATION_AVRO) {
                r->avro = avroenc_new(cfg->value_format, &r->fields, errstr, errstr_size);
                if (!r->avro)
                        goto fail;
                if (*cfg->schema_registry_url &&
                    !(r->registry = registry_new(cfg->schema_registry_url, errstr, errstr_size)))
                        goto fail;
                log_info("relay", "avro value schema", "fingerprint=%016llx registry=%s",
                         (unsigned long long)avroenc_fingerprint(r->avro),
                         r->registry ? "yes" : "no");
        }
        r->kafka = kafka_new(cfg, on_delivery, r, errstr, errstr_size);
        if (!r->kafka)
                goto fail;
        /* A wave may wait a whole delivery timeout for its reports (broker
         * down): /healthz must not call that a stall and get the pod killed. */
        if (http)
                http_set_stall(http, kafka_delivery_timeout_ms(r->kafka) / 1000 + 60);
        return r;
fail:
        relay_destroy(r);
        return NULL;
}

void relay_destroy(struct relay *r) {
        if (!r)
                return;
        kafka_destroy(r->kafka);
        db_batch_clear(&r->batch);
        db_batch_clear(&r->next);
        db_destroy(r->db);
        if (r->rows)
                for (int i = 0; i < r->cfg->batch_size; i++)
                        free(r->rows[i].topic);
        free(r->rows);
        free(r->outs);
        buf_free(&r->topic);
        buf_free(&r->value);
        buf_free(&r->scratch);
        buf_free(&r->subject);
        avroenc_destroy(r->avro);
        registry_destroy(r->registry);
        free(r);
}

/* A row that never reached the producer. */
static void row_fail(struct row_state *st, int permanent, const char *code, const char *msg) {
        st->done = 1;
        st->ok = 0;
        st->permanent = permanent;
        st->code = code;
        snprintf(st->message, sizeof st->message, "%.159s", msg);
        encode_utf8_clean(st->message); /* cut mid-character, or foreign text */
}

/* Encodes and produces row i; records an immediate failure in its state. */
static void produce_row(struct relay *r, size_t i) {
        const struct config *cfg = r->cfg;
        const struct outbox_event *ev = &r->batch.events[i];
        struct row_state *st = &r->rows[i];
        char err[160];

        if (encode_topic(cfg->topic_template, ev, &r->topic) != 0) {
                row_fail(st, 1, "ENCODE_FAILED", "topic could not be formed");
                return;
        }
        st->topic = strdup(r->topic.data);
        if (!st->topic) {
                row_fail(st, 0, "ENCODE_FAILED", "out of memory");
                return;
        }
        /* The schema id (subject <topic>-value) goes into a header; a
         * tombstone has no value, so it needs no schema. */
        int schema_id = -1;
        char sid[16];
        if (r->registry && ev->payload) {
                const char *code;
                buf_reset(&r->subject);
                if (buf_appendf(&r->subject, "%s-value", st->topic) != 0) {
                        row_fail(st, 0, "ENCODE_FAILED", "out of memory");
                        return;
                }
                if (registry_schema_id(r->registry, r->subject.data, avroenc_schema_json(r->avro),
                                       &schema_id, &code, err, sizeof err) != 0) {
                        row_fail(st, 0, code, err); /* retriable, never DEAD at once */
                        return;
                }
                snprintf(sid, sizeof sid, "%d", schema_id);
        }
        int n = encode_headers_fields(
                ev, cfg->producer_name, r->avro ? "application/avro" : "application/json",
                schema_id >= 0 ? sid : NULL, &r->fields, r->hdrs, &r->scratch, err, sizeof err);
        if (n < 0) {
                row_fail(st, 1, "INVALID_HEADERS", err);
                return;
        }
        const void *value = NULL;
        size_t value_len = 0;
        if (ev->payload && r->avro) {
                if (avroenc_encode(r->avro, ev, schema_id, &r->value, err, sizeof err) != 0) {
                        row_fail(st, 1, "ENCODE_FAILED", err);
                        return;
                }
                value = r->value.data;
                value_len = r->value.len;
        } else if (ev->payload && cfg->value_format == VALUE_PAYLOAD) {
                value = ev->payload;
                value_len = ev->payload_len;
        } else if (ev->payload) {
                if (encode_envelope_json_fields(ev, &r->fields, &r->value) != 0) {
                        row_fail(st, 0, "ENCODE_FAILED", "out of memory encoding the envelope");
                        return;
                }
                value = r->value.data;
                value_len = r->value.len;
        }
        const char *key = ev->partition_key ? ev->partition_key : ev->aggregate_id;
        st->size = value_len;
        struct kafka_result res;
        if (kafka_produce(r->kafka, st->topic, key, strlen(key), value, value_len, r->hdrs, n, st,
                          &res) != 0)
                row_fail(st, res.permanent, res.code, res.message);
        else
                metrics_observe(M_EVENT_SIZE, (double)value_len);
}

/* kafka_wait() tick: reads the lock ahead's rows as they come, so the
 * server finishes its transaction (row locks, snapshot) without waiting for
 * the delivery reports. */
static int poll_next(void *arg) {
        struct relay *r = arg;
        return db_lock_poll(r->db);
}

/* librdkafka's own message timeout may report up to about a second late
 * (timeout scans); messages sent just before every broker went away are not
 * timed out at all by the idempotent producer until it reconnects. Past the
 * delivery timeout plus this slack the batch is purged, so a batch (and a
 * SIGTERM) waits at most about the delivery timeout. */
#define DELIVERY_SLACK_MS 1000

/* Waits for every delivery report of wave `wave` (bounded by the delivery
 * timeout), then handles a fatal producer error: acknowledged rows stay
 * acknowledged, the wave's others fail and the producer is rebuilt. */
static int await_reports(struct relay *r, int wave) {
        char err[512];
        kafka_wait(r->kafka, kafka_delivery_timeout_ms(r->kafka) + DELIVERY_SLACK_MS,
                   db_lock_in_flight(r->db) ? poll_next : NULL, r);
        if (r->http)
                http_heartbeat(r->http);
        for (size_t i = 0; i < r->batch.count; i++)
                if (r->rows[i].wave == wave && !r->rows[i].done)
                        row_fail(&r->rows[i], 0, "_TIMED_OUT", "no delivery report in time");
        int fatal = kafka_fatal(r->kafka, err, sizeof err);
        if (!fatal && kafka_outstanding(r->kafka) == 0)
                return 0;
        if (!fatal) {
                /* Reports even a purge did not bring: they must never land in
                 * a later batch's row states, so the producer goes. */
                snprintf(err, sizeof err, "%d delivery reports missing after a purge",
                         kafka_outstanding(r->kafka));
        }
        log_error("kafka", "rebuilding the producer", "reason=%s", err);
        for (size_t i = 0; i < r->batch.count; i++)
                if (r->rows[i].wave == wave && !r->rows[i].ok)
                        row_fail(&r->rows[i], 0, "_FATAL", err);
        kafka_destroy(r->kafka);
        r->kafka = kafka_new(r->cfg, on_delivery, r, err, sizeof err);
        if (!r->kafka) {
                log_error("kafka", "cannot rebuild the producer", "reason=%s", err);
                return -1;
        }
        return 0;
}

/* Turns row states into outcomes and counts them in the metrics. */
static size_t build_outcomes(struct relay *r, double acked_at) {
        const struct config *cfg = r->cfg;
        size_t n = r->batch.count, failed = 0, dead = 0;
        const char *first_code = NULL;
        for (size_t i = 0; i < n; i++) {
                const struct outbox_event *ev = &r->batch.events[i];
                struct row_state *st = &r->rows[i];
                struct db_outcome *o = &r->outs[i];
                o->outbox_id = ev->outbox_id;
                o->tid = ev->tid;
                o->code = st->code;
                o->message = st->message;
                o->delay_ms = 0;
                o->uncounted = 0;
                o->marked = 0;
                if (st->released) {
                        o->status = DB_RELEASED;
                        o->code = o->message = NULL;
                        continue;
                }
                if (st->ok) {
                        o->status = DB_PUBLISHED;
                        o->code = o->message = NULL;
                        metrics_add(M_EVENTS_PUBLISHED, st->topic, 1);
                        metrics_observe(M_PUBLISH_LATENCY, acked_at - ev->occurred_at_epoch);
                        continue;
                }
                /* An unreachable schema registry says nothing about the row:
                 * it never uses up attempts (issue 5: registry down, never DEAD). */
                int counts = !st->code || strcmp(st->code, "REGISTRY_UNAVAILABLE") != 0;
                if (st->permanent || (counts && ev->attempt_count >= cfg->max_attempts)) {
                        o->status = DB_DEAD;
                        if (!st->permanent) {
                                char why[sizeof st->message];
                                snprintf(why, sizeof why, "%.100s (attempt %d of %d)", st->message,
                                         ev->attempt_count, cfg->max_attempts);
                                memcpy(st->message, why, sizeof why);
                                encode_utf8_clean(st->message);
                        }
                        metrics_add(M_EVENTS_DEAD, st->code, 1);
                        log_warn("relay", "event dead", "outbox_id=%s topic=%s err=%s reason=%s",
                                 ev->outbox_id, st->topic ? st->topic : "-", st->code, st->message);
                        dead++;
                } else {
                        o->status = DB_FAILED;
                        o->uncounted = !counts;
                        o->delay_ms = relay_backoff_ms(ev->attempt_count, cfg->backoff_initial_ms,
                                                       cfg->backoff_max_ms, &r->seed);
                        metrics_add(M_EVENTS_FAILED, st->code, 1);
                        failed++;
                }
                if (!first_code)
                        first_code = st->code;
        }
        if (failed)
                log_warn("relay", "events failed, will retry",
                         "failed=%zu dead=%zu batch=%zu err=%s", failed, dead, n, first_code);
        return n;
}

/* Connects if needed; on failure waits the backoff and returns -1. */
static int ensure_db(struct relay *r, volatile sig_atomic_t *stop) {
        return lifecycle_ensure_db(r->db, &r->reconnect_ms, r->http, stop);
}

/* After a stop request, between retries of the database: 1 once
 * STOP_MARK_GRACE_S have passed since the first such retry (one grace for
 * the whole stop), else pauses briefly and returns 0. */
static int stop_grace_over(struct relay *r) {
        if (r->stop_deadline == 0)
                r->stop_deadline = clock_mono_s() + STOP_MARK_GRACE_S;
        else if (clock_mono_s() > r->stop_deadline)
                return 1;
        struct timespec ts = {0, 200000000L};
        nanosleep(&ts, NULL);
        return 0;
}

/* Marks the batch, retrying through database outages: rows must not stay
 * PUBLISHING. After a stop request it gives up after STOP_MARK_GRACE_S (the
 * sweeper returns what is left). */
static int mark_batch(struct relay *r, size_t n, volatile sig_atomic_t *stop) {
        char err[512];
        for (;;) {
                size_t lost = 0;
                if (ensure_db(r, stop) == 0 &&
                    db_mark(r->db, r->outs, n, &lost, err, sizeof err) == 0) {
                        if (lost) {
                                metrics_add(M_LOCK_LOST, NULL, (double)lost);
                                log_warn("relay", "locks lost before marking", "rows=%zu", lost);
                        }
                        r->reconnect_ms = LIFECYCLE_RECONNECT_MIN_MS;
                        return 0;
                }
                if (db_connected(r->db)) {
                        /* connected but failing: wait like a reconnect would */
                        log_warn("db", "mark failed, retrying", "retry_ms=%d err=%s",
                                 r->reconnect_ms, err);
                        lifecycle_backoff(r->http, &r->reconnect_ms, stop);
                }
                if (*stop && stop_grace_over(r)) {
                        log_error("relay", "cannot mark the batch before stopping", "rows=%zu", n);
                        return -1;
                }
        }
}

static void sample_table(struct relay *r) {
        double counts[DB_STATUS_COUNT], age;
        char err[512];
        double t = clock_mono_s();
        if (t < r->next_sample)
                return;
        r->next_sample = t + SAMPLE_INTERVAL_S;
        if (db_sample(r->db, counts, &age, err, sizeof err) != 0) {
                log_warn("db", "sampling the table failed", "err=%s", err);
                return;
        }
        double took = clock_mono_s() - t;
        int slow = took * SAMPLE_SPACING > SAMPLE_INTERVAL_S;
        if (slow)
                r->next_sample = t + took * SAMPLE_SPACING;
        if (slow != r->sample_slow)
                log_info("relay",
                         slow ? "table sample slow, sampling less often"
                              : "table sample fast again, sampling at the usual interval",
                         "seconds=%.3f next_in_s=%.1f", took, r->next_sample - t);
        r->sample_slow = slow;
        log_debug("relay", "table sampled", "seconds=%.3f next_in_s=%.1f", took,
                  r->next_sample - t);
        for (int i = 0; i < DB_STATUS_COUNT; i++)
                metrics_set(M_EVENTS, db_status_names[i], counts[i]);
        metrics_set(M_OLDEST_PENDING_AGE, NULL, age);
}

/* Numbers each row's position in its aggregate's run of consecutive versions
 * (rows come ordered by aggregate and version; without the guard every row is
 * wave 0). Version n+1 is produced in the wave after n, once n's delivery
 * report said it was acknowledged: an idempotent producer keeps order within a
 * partition but may leave a gap when a message times out, and a later version
 * must never reach Kafka before an earlier one (G2). Returns the wave count. */
static int assign_waves(struct relay *r) {
        int waves = 0;
        for (size_t i = 0; i < r->batch.count; i++) {
                const struct outbox_event *e = &r->batch.events[i], *p = e - 1;
                free(r->rows[i].topic);
                memset(&r->rows[i], 0, sizeof r->rows[i]);
                if (i > 0 && r->cfg->ordering == ORDERING_AGGREGATE &&
                    !strcmp(e->aggregate_id, p->aggregate_id) &&
                    !strcmp(e->aggregate_type, p->aggregate_type) &&
                    !strcmp(e->tenant_id, p->tenant_id))
                        r->rows[i].wave = r->rows[i - 1].wave + 1;
                if (r->rows[i].wave + 1 > waves)
                        waves = r->rows[i].wave + 1;
        }
        return waves;
}

/* Hands the rows of r->next back unproduced (DB_RELEASED: the attempt does
 * not count). -1 when they could not be marked before a stop. */
static int release_next(struct relay *r, volatile sig_atomic_t *stop) {
        size_t n = r->next.count;
        for (size_t i = 0; i < n; i++) {
                memset(&r->outs[i], 0, sizeof r->outs[i]);
                r->outs[i].outbox_id = r->next.events[i].outbox_id;
                r->outs[i].status = DB_RELEASED;
        }
        int rc = mark_batch(r, n, stop);
        if (rc != 0)
                r->unmarked = 1; /* left PUBLISHING: the sweeper returns them */
        db_batch_clear(&r->next);
        return rc;
}

/* Moves the batch locked ahead into r->batch when it may still go out; 1 if
 * it did. A batch held too long goes back. Its connection is the one it was
 * locked on: after a reconnect, reclaim() released it before any batch ran. */
static int take_next(struct relay *r, volatile sig_atomic_t *stop) {
        if (!r->next.count)
                return 0;
        if (*stop) {
                release_next(r, stop); /* a stopping relay publishes no new batch */
                return 0;
        }
        if (clock_mono_s() - r->next_locked_at > AHEAD_MAX_AGE_S) {
                log_warn("relay", "releasing a batch locked ahead: held too long", "rows=%zu",
                         r->next.count);
                release_next(r, stop);
                return 0;
        }
        r->batch = r->next;
        memset(&r->next, 0, sizeof r->next);
        /* Locked ahead, the batch may have come short: versions whose
         * predecessors were still in flight. Now that those may be marked,
         * fill it up (each batch costs a produce request per partition). */
        if (r->batch.count < (size_t)r->cfg->batch_size && db_connected(r->db)) {
                char err[512];
                if (db_lock_more(r->db, r->cfg->batch_size - (int)r->batch.count,
                                 r->cfg->ordering == ORDERING_AGGREGATE, &r->batch, err,
                                 sizeof err) != 0)
                        log_warn("db", "filling up a batch locked ahead failed", "err=%s", err);
        }
        return 1;
}

/* Collects the rows of the lock statement sent ahead (at `sent`) into r->next. */
static void receive_next(struct relay *r, double sent) {
        char err[512];
        if (db_lock_receive(r->db, &r->next, err, sizeof err) != 0) {
                log_warn("db", "locking the next batch ahead failed", "err=%s", err);
                return;
        }
        if (r->next.count == 0)
                r->ahead_after = clock_mono_s() + AHEAD_PAUSE_S;
        r->next_locked_at = sent;
}

/* One batch: lock (or take the batch locked ahead), lock the next one ahead
 * while this one is produced wave by wave and acknowledged, mark. Returns
 * rows locked, or -1. The guard keeps the two batches apart: a version whose
 * predecessor is in this batch is not ready for the next. */
static long run_batch(struct relay *r, volatile sig_atomic_t *stop) {
        char err[512];
        double started = clock_mono_s();
        int ordering = r->cfg->ordering == ORDERING_AGGREGATE;
        if (!take_next(r, stop)) {
                if (*stop)
                        return 0; /* releasing the batch locked ahead took the stop request */
                if (db_lock_batch(r->db, r->cfg->batch_size, ordering, &r->batch, err,
                                  sizeof err) != 0) {
                        log_warn("db", "lock batch failed", "err=%s", err);
                        return -1;
                }
        }
        size_t n = r->batch.count;
        if (n == 0)
                return 0;
        double ahead_sent = clock_mono_s();
        if (!*stop && ahead_sent >= r->ahead_after &&
            db_lock_send(r->db, r->cfg->batch_size, ordering, 0, err, sizeof err) != 0)
                log_warn("db", "locking the next batch ahead failed", "err=%s", err);
        int waves = assign_waves(r);
        int rc = 0;
        for (int w = 0; w < waves; w++) {
                for (size_t i = 0; i < n; i++) {
                        struct row_state *st = &r->rows[i];
                        if (st->wave != w)
                                continue;
                        /* rows[i - 1] is the previous version of the same aggregate */
                        if (w > 0 && (rc != 0 || *stop || !r->rows[i - 1].ok)) {
                                st->done = st->released = 1;
                                continue;
                        }
                        produce_row(r, i);
                }
                if (rc == 0)
                        rc = await_reports(r, w);
        }
        if (db_lock_in_flight(r->db))
                receive_next(r, ahead_sent);
        build_outcomes(r, clock_wall_s());
        if (mark_batch(r, n, stop) != 0) {
                r->unmarked = 1; /* left PUBLISHING: the sweeper returns them */
                rc = -1;
        }
        db_batch_clear(&r->batch);
        metrics_add(M_BATCHES, NULL, 1);
        metrics_observe(M_BATCH_DURATION, clock_mono_s() - started);
        log_debug("relay", "batch done", "rows=%zu seconds=%.3f", n, clock_mono_s() - started);
        return rc == 0 ? (long)n : -1;
}

/* After every (re)connect, with no batch in flight: rows this relay id still
 * holds are orphans (a lock statement whose result the lost connection took
 * with it, or an earlier process with this id that died): take them back at
 * once instead of waiting for the sweeper's lock timeout. */
static int take_back_own(struct relay *r) {
        char err[512];
        long long n;
        if (db_take_back_own(r->db, r->cfg->max_attempts, &n, err, sizeof err) != 0) {
                log_warn("db", "taking back own locks failed", "err=%s", err);
                return -1;
        }
        r->seen_connects = db_connects(r->db);
        if (n)
                log_warn("relay", "took back rows locked under this relay id", "rows=%lld", n);
        return 0;
}

/* Whether this relay id may hold rows it does not know of: the connection
 * was replaced since own locks were last checked, or a lock statement's
 * rows were lost (db_locks_unknown()). */
static int may_hold_unknown(struct relay *r) {
        return db_connects(r->db) != r->seen_connects || db_locks_unknown(r->db);
}

/* Then, with no batch in flight: the batch locked ahead goes back
 * unattempted (its rows are still this relay's, and the mark is fenced),
 * and whatever else this relay id holds is taken back. */
static int reclaim(struct relay *r, volatile sig_atomic_t *stop) {
        if (r->next.count && release_next(r, stop) != 0)
                return -1;
        return take_back_own(r);
}

int relay_run(struct relay *r, volatile sig_atomic_t *stop) {
        log_info("relay", "started", "relay_id=%s table=%s batch_size=%d ordering=%s",
                 r->cfg->relay_id, r->cfg->table, r->cfg->batch_size,
                 r->cfg->ordering == ORDERING_AGGREGATE ? "aggregate" : "none");
        while (!*stop) {
                if (r->http)
                        http_heartbeat(r->http);
                metrics_set(M_LAST_BATCH_TIMESTAMP, NULL, clock_wall_s());
                if (ensure_db(r, stop) != 0)
                        continue;
                if (may_hold_unknown(r) && reclaim(r, stop) != 0) {
                        lifecycle_nap(r->http, r->cfg->poll_interval_ms, stop);
                        continue;
                }
                if (r->http)
                        http_set_ready(r->http, kafka_broker_up(r->kafka));
                sample_table(r);
                long n = run_batch(r, stop);
                if (n < 0 && !r->kafka)
                        break; /* the producer could not be rebuilt */
                if (n > 0)
                        continue; /* more may be due at once (next versions, backlog) */
                if (n < 0)
                        /* no hot loop on a failing query */
                        lifecycle_nap(r->http, r->cfg->poll_interval_ms, stop);
                else if (db_wait(r->db, r->cfg->poll_interval_ms) < 0)
                        log_warn("db", "connection lost while idle", NULL);
                kafka_poll(r->kafka, 0);
        }
        if (r->next.count)
                release_next(r, stop);
        /* rows a lost lock statement may hold: taken back if the database
         * can be reached within the stop grace */
        while (may_hold_unknown(r)) {
                if (ensure_db(r, stop) == 0 && take_back_own(r) == 0)
                        break;
                if (stop_grace_over(r)) {
                        log_error("relay", "rows a lost lock statement may hold stay PUBLISHING",
                                  "relay_id=%s", r->cfg->relay_id);
                        r->unmarked = 1; /* the sweeper returns them */
                        break;
                }
        }
        log_info("relay", "stopped", "relay_id=%s", r->cfg->relay_id);
        return r->unmarked || !r->kafka ? 1 : 0;
}
