/* relay.c - the relay's loop: lock a batch, produce it in waves, mark it. */
#include "relay.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "claims.h"
#include "clock.h"
#include "db.h"
#include "encode.h"
#include "kafka.h"
#include "lifecycle.h"
#include "log.h"
#include "message.h"
#include "metrics.h"

#define SAMPLE_INTERVAL_S 10.0
/* The table sample counts every unpublished row: with a large backlog it
 * takes long, and the loop waits for it. The next sample waits at least this
 * many times as long as the last one took, so sampling keeps to about 2 % of
 * the relay's time however large the backlog. */
#define SAMPLE_SPACING 50.0
/* A version gap is reported (gauge, log line) once it has held its
 * aggregate this long: versions committed a moment out of order are not. */
#define GAP_REPORT_AFTER_S 5
/* Gaps logged per sample at most; each is logged once (remembered by hash,
 * up to GAP_SEEN_MAX, then forgotten all at once). */
#define GAP_LOG_MAX  20
#define GAP_SEEN_MAX 1024
/* The planner's estimate of the unpublished rows is out of date when it is
 * off by this factor and this many rows; then the relay analyzes the table,
 * at most every STATS_ANALYZE_EVERY_S (every STATS_REFUSED_EVERY_S once it
 * was refused). */
#define STATS_OFF_FACTOR      10.0
#define STATS_OFF_ROWS        10000.0
#define STATS_ANALYZE_EVERY_S 60.0
#define STATS_REFUSED_EVERY_S 3600.0
/* librdkafka's own message timeout may report up to about a second late
 * (timeout scans); messages sent just before every broker went away are not
 * timed out at all by the idempotent producer until it reconnects. Past the
 * delivery timeout plus this slack the batch is purged, so a batch (and a
 * SIGTERM) waits at most about the delivery timeout. */
#define DELIVERY_SLACK_MS 1000
/* /healthz tolerates a wave's whole delivery timeout (broker down) plus this. */
#define STALL_SLACK_S 60

/* What happened to one row of the batch. */
struct row_state {
        int done; /* outcome known (delivery report or produce error) */
        int ok;
        int permanent;
        int uncounted;    /* the attempt does not count (the schema registry was down) */
        int released;     /* never produced: goes back unattempted (DB_MARK_RELEASED) */
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
        struct claims *claims;   /* the rows this relay holds */
        struct message *message; /* what a row becomes on Kafka */
        struct kafka *kafka;
        struct row_state *rows; /* of the batch being published */
        unsigned seed;
        double next_sample;                         /* no table sample before this (monotonic) */
        double analyze_after;                       /* no ANALYZE before this (monotonic) */
        unsigned long long gaps_seen[GAP_SEEN_MAX]; /* hashes of gaps logged */
        size_t ngaps_seen;
        int sample_slow; /* the last sample stretched the interval */
};

enum db_order relay_db_order(int ordering) {
        return ordering == ORDERING_NONE         ? DB_ORDER_NONE
               : ordering == ORDERING_INCREASING ? DB_ORDER_INCREASING
                                                 : DB_ORDER_CONSECUTIVE;
}

long long relay_backoff_ms(int attempt, int initial_ms, int max_ms, unsigned *seed) {
        long long d = initial_ms;
        for (int i = 1; i < attempt && d < max_ms; i++)
                d *= 2;
        if (d > max_ms)
                d = max_ms;
        long long half = d / 2;
        return half + (d - half > 0 ? (long long)(rand_r(seed) % (d - half + 1)) : 0);
}

/* Records the outcome in the row's state, nothing more. */
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
        r->rows = calloc((size_t)cfg->batch_size, sizeof *r->rows);
        r->db = db_new(cfg->database_url, cfg->table, cfg->relay_id);
        if (!r->rows || !r->db) {
                snprintf(errstr, errstr_size, "out of memory");
                goto fail;
        }
        db_set_test_hooks(r->db, cfg->test_lock_delay_ms, cfg->test_sample_delay_ms);
        db_set_order(r->db, relay_db_order(cfg->ordering));
        r->claims = claims_new(cfg, r->db, http, errstr, errstr_size);
        if (!r->claims)
                goto fail;
        r->message = message_new(cfg, errstr, errstr_size);
        if (!r->message)
                goto fail;
        unsigned long long fingerprint;
        int registry;
        if (message_avro(r->message, &fingerprint, &registry))
                log_info("relay", "avro value schema", "fingerprint=%016llx registry=%s",
                         fingerprint,
                         !registry                            ? "no"
                         : cfg->schema_registry_auto_register ? "register"
                                                              : "lookup");
        r->kafka = kafka_new(cfg, on_delivery, r, errstr, errstr_size);
        if (!r->kafka)
                goto fail;
        /* A wave may wait a whole delivery timeout for its reports (broker
         * down): /healthz must not call that a stall and get the pod killed. */
        if (http)
                http_set_stall(http, kafka_delivery_timeout_ms(r->kafka) / 1000 + STALL_SLACK_S);
        return r;
fail:
        relay_destroy(r);
        return NULL;
}

void relay_destroy(struct relay *r) {
        if (!r)
                return;
        kafka_destroy(r->kafka); /* first: its reports point into the rows */
        claims_destroy(r->claims);
        db_destroy(r->db);
        if (r->rows)
                for (int i = 0; i < r->cfg->batch_size; i++)
                        free(r->rows[i].topic);
        free(r->rows);
        message_destroy(r->message);
        free(r);
}

/* A row that never reached the producer. */
static void row_fail(struct row_state *st, int permanent, int uncounted, const char *code,
                     const char *msg) {
        st->done = 1;
        st->ok = 0;
        st->permanent = permanent;
        st->uncounted = uncounted;
        st->code = code;
        snprintf(st->message, sizeof st->message, "%.159s", msg);
        encode_utf8_clean(st->message); /* cut mid-character, or foreign text */
}

/* Encodes and produces one row; records an immediate failure in its state. */
static void produce_row(struct relay *r, const struct outbox_event *ev, struct row_state *st) {
        struct message_parts m;
        struct message_error why;

        int built = message_build(r->message, ev, &m, &why);
        /* the topic outlives the message: the delivery report's metrics and
         * the log name it */
        if (m.topic && !(st->topic = strdup(m.topic))) {
                row_fail(st, 0, 0, "ENCODE_FAILED", "out of memory");
                return;
        }
        if (built != 0) {
                row_fail(st, why.permanent, why.uncounted, why.code, why.text);
                return;
        }
        st->size = m.value_len;
        struct kafka_result res;
        if (kafka_produce(r->kafka, m.topic, m.key, m.key_len, m.value, m.value_len, m.headers,
                          m.header_count, st, &res) != 0)
                row_fail(st, res.permanent, 0, res.code, res.message);
        else
                metrics_observe(M_EVENT_SIZE, (double)m.value_len);
}

/* Waits for every delivery report of wave `wave` (bounded by the delivery
 * timeout), reading the lock ahead's rows as they come so the server
 * finishes that transaction meanwhile. Then handles a fatal producer error:
 * acknowledged rows stay acknowledged, the wave's others fail and the
 * producer is rebuilt. */
static int await_reports(struct relay *r, size_t n, int wave) {
        char err[512];
        kafka_wait(r->kafka, kafka_delivery_timeout_ms(r->kafka) + DELIVERY_SLACK_MS,
                   claims_ahead_pending(r->claims) ? claims_poll_ahead : NULL, r->claims);
        if (r->http)
                http_heartbeat(r->http);
        for (size_t i = 0; i < n; i++)
                if (r->rows[i].wave == wave && !r->rows[i].done)
                        row_fail(&r->rows[i], 0, 0, "_TIMED_OUT", "no delivery report in time");
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
        for (size_t i = 0; i < n; i++)
                if (r->rows[i].wave == wave && !r->rows[i].ok)
                        row_fail(&r->rows[i], 0, 0, "_FATAL", err);
        kafka_destroy(r->kafka);
        r->kafka = kafka_new(r->cfg, on_delivery, r, err, sizeof err);
        if (!r->kafka) {
                log_error("kafka", "cannot rebuild the producer", "reason=%s", err);
                return -1;
        }
        return 0;
}

/* Numbers each row's position in its aggregate's run of consecutive versions
 * (rows come ordered by aggregate and version; without the guard every row is
 * wave 0). Version n+1 is produced in the wave after n, once n's delivery
 * report said it was acknowledged: an idempotent producer keeps order within a
 * partition but may leave a gap when a message times out, and a later version
 * must never reach Kafka before an earlier one. Returns the wave count. */
static int assign_waves(struct relay *r, const struct db_batch *b) {
        int waves = 0;
        for (size_t i = 0; i < b->count; i++) {
                const struct outbox_event *e = &b->events[i], *p = e - 1;
                free(r->rows[i].topic);
                memset(&r->rows[i], 0, sizeof r->rows[i]);
                if (i > 0 && r->cfg->ordering != ORDERING_NONE &&
                    !strcmp(e->aggregate_id, p->aggregate_id) &&
                    !strcmp(e->aggregate_type, p->aggregate_type) &&
                    !strcmp(e->tenant_id, p->tenant_id))
                        r->rows[i].wave = r->rows[i - 1].wave + 1;
                if (r->rows[i].wave + 1 > waves)
                        waves = r->rows[i].wave + 1;
        }
        return waves;
}

/* A version committed after a later one of its aggregate was published: it
 * cannot reach Kafka in order, so it goes DEAD unsent, and says why. */
static void late_row(const struct outbox_event *ev, struct row_state *st) {
        char why[160];
        snprintf(why, sizeof why,
                 "version %lld committed after version %lld was published: not sent "
                 "(per-aggregate order)",
                 ev->aggregate_version, ev->late_after);
        row_fail(st, 1, 0, "LATE_VERSION", why);
}

/* Produces the batch wave by wave, each wave's reports awaited before the
 * next; a version whose predecessor was not acknowledged (or after a stop
 * request, or a lost producer) is not produced but given back. -1 when the
 * producer could not be rebuilt. */
static int produce_waves(struct relay *r, const struct db_batch *b, volatile sig_atomic_t *stop) {
        int waves = assign_waves(r, b);
        int rc = 0;
        for (int w = 0; w < waves; w++) {
                for (size_t i = 0; i < b->count; i++) {
                        struct row_state *st = &r->rows[i];
                        if (st->wave != w)
                                continue;
                        if (b->events[i].late) {
                                late_row(&b->events[i], st);
                                continue;
                        }
                        /* rows[i - 1] is the previous version of the same aggregate */
                        if (w > 0 && (rc != 0 || *stop || !r->rows[i - 1].ok)) {
                                st->done = st->released = 1;
                                continue;
                        }
                        produce_row(r, &b->events[i], st);
                }
                if (rc == 0)
                        rc = await_reports(r, b->count, w);
        }
        return rc;
}

/* Turns row states into outcomes and counts them in the metrics. */
static size_t build_outcomes(struct relay *r, const struct db_batch *b, struct db_outcome *outs,
                             double acked_at) {
        const struct config *cfg = r->cfg;
        size_t n = b->count, failed = 0, dead = 0;
        const char *first_code = NULL;
        for (size_t i = 0; i < n; i++) {
                const struct outbox_event *ev = &b->events[i];
                struct row_state *st = &r->rows[i];
                struct db_outcome *o = &outs[i];
                o->outbox_id = ev->outbox_id;
                o->tid = ev->tid;
                o->code = st->code;
                o->message = st->message;
                o->delay_ms = 0;
                o->uncounted = 0;
                o->marked = 0;
                if (st->released) {
                        o->mark = DB_MARK_RELEASED;
                        o->code = o->message = NULL;
                        continue;
                }
                if (st->ok) {
                        o->mark = DB_MARK_PUBLISHED;
                        o->code = o->message = NULL;
                        metrics_add(M_EVENTS_PUBLISHED, st->topic, 1);
                        metrics_observe(M_PUBLISH_LATENCY, acked_at - ev->occurred_at_epoch);
                        continue;
                }
                if (st->permanent || (!st->uncounted && ev->attempt_count >= cfg->max_attempts)) {
                        o->mark = DB_MARK_DEAD;
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
                        o->mark = DB_MARK_FAILED;
                        o->uncounted = st->uncounted;
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

/* One batch: lock (and lock the next one ahead), produce in waves, mark.
 * Returns rows locked, or -1. */
static long run_batch(struct relay *r, volatile sig_atomic_t *stop) {
        double started = clock_mono_s();
        const struct db_batch *b;
        if (claims_lock(r->claims, stop, &b) != 0)
                return -1;
        if (b->count == 0)
                return 0;
        int rc = produce_waves(r, b, stop);
        claims_receive_ahead(r->claims);
        size_t n = build_outcomes(r, b, claims_outcomes(r->claims), clock_wall_s());
        if (claims_settle(r->claims, n, stop) != 0)
                rc = -1;
        metrics_add(M_BATCHES, NULL, 1);
        metrics_observe(M_BATCH_DURATION, clock_mono_s() - started);
        log_debug("relay", "batch done", "rows=%zu seconds=%.3f", n, clock_mono_s() - started);
        return rc == 0 ? (long)n : -1;
}

/* Hash of a gap's aggregate and held version. */
static unsigned long long gap_hash(const struct db_gap *g) {
        unsigned long long h = 1469598103934665603ULL;
        const char *parts[3] = {g->tenant_id, g->aggregate_type, g->aggregate_id};
        for (int i = 0; i < 3; i++)
                for (const char *p = parts[i];; p++) {
                        h = (h ^ (unsigned char)*p) * 1099511628211ULL;
                        if (!*p)
                                break;
                }
        return h ^ (unsigned long long)g->held_version * 0x9E3779B97F4A7C15ULL;
}

/* 1 the first time gap g is seen (remembered from then on). */
static int gap_is_new(struct relay *r, const struct db_gap *g) {
        unsigned long long h = gap_hash(g);
        for (size_t i = 0; i < r->ngaps_seen; i++)
                if (r->gaps_seen[i] == h)
                        return 0;
        if (r->ngaps_seen == GAP_SEEN_MAX)
                r->ngaps_seen = 0;
        r->gaps_seen[r->ngaps_seen++] = h;
        return 1;
}

/* Consecutive versions: versions held by a missing one, in the gauges, and
 * a line for each gap the first time it is seen. */
static void sample_gaps(struct relay *r) {
        struct db_gap gaps[GAP_LOG_MAX];
        size_t n;
        long long total;
        char err[512];
        if (db_version_gaps(r->db, GAP_REPORT_AFTER_S, gaps, GAP_LOG_MAX, &n, &total, err,
                            sizeof err) != 0) {
                log_warn("db", "looking for version gaps failed", "err=%s", err);
                return;
        }
        metrics_set(M_VERSION_GAPS, NULL, (double)total);
        metrics_set(M_VERSION_GAP_AGE, NULL, n ? gaps[0].age_s : 0);
        for (size_t i = 0; i < n; i++)
                if (gap_is_new(r, &gaps[i]))
                        log_warn("relay", "version gap holds an aggregate",
                                 "tenant_id=%s aggregate_type=%s aggregate_id=%s held_version=%lld "
                                 "missing_from=%lld missing_to=%lld age_s=%.0f",
                                 gaps[i].tenant_id, gaps[i].aggregate_type, gaps[i].aggregate_id,
                                 gaps[i].held_version, gaps[i].prev_version + 1,
                                 gaps[i].held_version - 1, gaps[i].age_s);
}

/* Keeps the planner's picture of the backlog true. The guard's probes pick
 * their index by how many rows it believes unpublished: with statistics taken
 * while the outbox was empty, a burst's lock statements ran 10 to 20 times
 * slower (the wrong partial index, scanned whole), until autovacuum analyzed
 * again, after a tenth of the table changed. */
static void check_planner_stats(struct relay *r, double unpublished) {
        char err[512];
        double planned;
        double t = clock_mono_s();
        if (t < r->analyze_after)
                return;
        if (db_planned_unpublished(r->db, &planned, err, sizeof err) != 0) {
                log_debug("db", "planner estimate failed", "err=%s", err);
                return;
        }
        double lo = planned < unpublished ? planned : unpublished;
        double hi = planned < unpublished ? unpublished : planned;
        if (hi - lo < STATS_OFF_ROWS || hi < lo * STATS_OFF_FACTOR)
                return;
        if (db_analyze(r->db, err, sizeof err) != 0) {
                log_warn("db", "planner statistics out of date and ANALYZE failed",
                         "planned_unpublished=%.0f unpublished=%.0f err=%s", planned, unpublished,
                         err);
                r->analyze_after = t + STATS_REFUSED_EVERY_S;
                return;
        }
        log_info("db", "planner statistics out of date: analyzed the table",
                 "planned_unpublished=%.0f unpublished=%.0f seconds=%.3f", planned, unpublished,
                 clock_mono_s() - t);
        r->analyze_after = t + STATS_ANALYZE_EVERY_S;
}

static void sample_table(struct relay *r) {
        double counts[DB_ROW_STATUS_COUNT], age;
        char err[512];
        double t = clock_mono_s();
        if (t < r->next_sample)
                return;
        r->next_sample = t + SAMPLE_INTERVAL_S;
        if (db_sample(r->db, counts, &age, err, sizeof err) != 0) {
                log_warn("db", "sampling the table failed", "err=%s", err);
                return;
        }
        if (r->cfg->ordering == ORDERING_AGGREGATE)
                sample_gaps(r);
        check_planner_stats(r, counts[DB_ROW_PENDING] + counts[DB_ROW_PUBLISHING] +
                                       counts[DB_ROW_FAILED] + counts[DB_ROW_DEAD]);
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
        for (int i = 0; i < DB_ROW_STATUS_COUNT; i++)
                metrics_set(M_EVENTS, db_row_status_names[i], counts[i]);
        metrics_set(M_OLDEST_PENDING_AGE, NULL, age);
}

/* The liveness signals of one loop turn: /healthz and the heartbeat gauge. */
static void heartbeat(struct relay *r) {
        if (r->http)
                http_heartbeat(r->http);
        metrics_set(M_LAST_BATCH_TIMESTAMP, NULL, clock_wall_s());
}

int relay_run(struct relay *r, volatile sig_atomic_t *stop) {
        log_info("relay", "started", "relay_id=%s table=%s batch_size=%d ordering=%s",
                 r->cfg->relay_id, r->cfg->table, r->cfg->batch_size,
                 r->cfg->ordering == ORDERING_AGGREGATE    ? "aggregate"
                 : r->cfg->ordering == ORDERING_INCREASING ? "increasing"
                                                           : "none");
        while (!*stop) {
                heartbeat(r);
                if (claims_ready(r->claims, stop) != 0)
                        continue;
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
        claims_finish(r->claims, stop);
        log_info("relay", "stopped", "relay_id=%s", r->cfg->relay_id);
        return claims_left_behind(r->claims) || !r->kafka ? 1 : 0;
}
