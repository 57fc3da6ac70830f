/* kafka.c - librdkafka idempotent producer with delivery reports. */
#include "kafka.h"

#include <errno.h>
#include <fcntl.h>
#include <librdkafka/rdkafka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "log.h"

/* Topics the producer remembers having asked about (past this many, new
 * topics wait for librdkafka's own one-second refresh). */
#define KNOWN_TOPICS_MAX 4096

struct kafka {
        rd_kafka_t *rk;
        kafka_delivery_cb *cb;
        void *ctx;
        kafka_stats_cb *stats_cb;
        int outstanding;
        int delivery_timeout_ms;
        long long max_message_bytes;
        int broker_up; /* a delivery succeeded since every broker was last reported down */
        char **known;  /* topics produced to (a set, KNOWN_TOPICS_MAX * 2 slots) */
        size_t nknown;
        int wake[2]; /* librdkafka writes to wake[1] when its main queue has events */
};

/* docs/DESIGN.md's producer defaults; anything may be overridden but idempotence. */
static const char *const defaults[][2] = {
        {"acks", "all"},
        {"enable.idempotence", "true"},
        {"max.in.flight.requests.per.connection", "5"},
        {"linger.ms", "5"},
        {"batch.size", "32768"},
        {"delivery.timeout.ms", "120000"},
        {"socket.nagle.disable", "true"},
        {"client.id", "outbox-relay"},
        /* A request stuck on a broker that stopped answering is given up
         * (and sent again to the partition's new leader) after this, not
         * librdkafka's 60 s: a hung broker holds its partitions' messages
         * about this long once leadership moved. */
        {"socket.timeout.ms", "10000"},
        /* Broker connections, round trips and queues for /metrics and
         * readiness (parsed by kafka_stats.c). */
        {"statistics.interval.ms", "1000"},
        /* The relay's metrics are its own /metrics. Pushing client metrics
         * to the brokers (KIP-714) would add requests, and the producer's
         * destruction waits up to a second for the last push, which a hung
         * broker never answers: a stop would take that much longer. */
        {"enable.metrics.push", "false"},
};

static int is_permanent(rd_kafka_resp_err_t err) {
        switch (err) {
        case RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE:
        case RD_KAFKA_RESP_ERR_INVALID_MSG_SIZE:
        case RD_KAFKA_RESP_ERR_INVALID_RECORD:
        case RD_KAFKA_RESP_ERR_RECORD_LIST_TOO_LARGE:
        case RD_KAFKA_RESP_ERR_TOPIC_EXCEPTION:
        case RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED:
        case RD_KAFKA_RESP_ERR__INVALID_ARG:
        case RD_KAFKA_RESP_ERR__BAD_MSG:
        case RD_KAFKA_RESP_ERR__KEY_SERIALIZATION:
        case RD_KAFKA_RESP_ERR__VALUE_SERIALIZATION: return 1;
        default: return 0;
        }
}

static void fill_result(struct kafka_result *res, rd_kafka_resp_err_t err) {
        res->ok = err == RD_KAFKA_RESP_ERR_NO_ERROR;
        res->permanent = !res->ok && is_permanent(err);
        res->code = rd_kafka_err2name(err);
        res->message = rd_kafka_err2str(err);
}

static void on_delivery(rd_kafka_t *rk, const rd_kafka_message_t *m, void *opaque) {
        struct kafka *k = opaque;
        (void)rk;
        k->outstanding--;
        if (m->err == RD_KAFKA_RESP_ERR_NO_ERROR)
                k->broker_up = 1;
        if (!k->cb)
                return;
        struct kafka_result res;
        fill_result(&res, m->err);
        k->cb(m->_private, &res, k->ctx);
}

static int on_stats(rd_kafka_t *rk, char *json, size_t len, void *opaque) {
        struct kafka *k = opaque;
        (void)rk;
        if (k->stats_cb)
                k->stats_cb(json, len, k->ctx);
        return 0; /* librdkafka frees json */
}

static void on_error(rd_kafka_t *rk, int err, const char *reason, void *opaque) {
        struct kafka *k = opaque;
        (void)rk;
        if (err == RD_KAFKA_RESP_ERR__ALL_BROKERS_DOWN)
                k->broker_up = 0;
        log_write(err == RD_KAFKA_RESP_ERR__FATAL ? LOG_ERROR : LOG_WARN, "kafka", "producer error",
                  "err=%s reason=%s", rd_kafka_err2name((rd_kafka_resp_err_t)err), reason);
}

static void on_log(const rd_kafka_t *rk, int level, const char *fac, const char *buf) {
        (void)rk;
        /* A broker connection's failure comes to the error callback too
         * (on_error logs it, with its code): logged once. */
        if (!strcmp(fac, "FAIL"))
                level = 7;
        enum log_level l = level <= 3   ? LOG_ERROR
                           : level <= 4 ? LOG_WARN
                           : level <= 6 ? LOG_INFO
                                        : LOG_DEBUG;
        if (log_enabled(l))
                log_write(l, "kafka", "librdkafka", "fac=%s text=%s", fac, buf);
}

static int conf_set(rd_kafka_conf_t *conf, const char *name, const char *value, const char *source,
                    char *errstr, size_t errstr_size) {
        char err[512];
        if (rd_kafka_conf_set(conf, name, value, err, sizeof err) == RD_KAFKA_CONF_OK)
                return 0;
        snprintf(errstr, errstr_size, "%s: %s", source, err);
        return -1;
}

/* Property names librdkafka treats as one (its messages use either). */
static const char *const aliases[][2] = {
        {"acks", "request.required.acks"},
        {"delivery.timeout.ms", "message.timeout.ms"},
        {"max.in.flight", "max.in.flight.requests.per.connection"},
        {"retries", "message.send.max.retries"},
        {"linger.ms", "queue.buffering.max.ms"},
};

static int same_property(const char *a, const char *b) {
        if (strcmp(a, b) == 0)
                return 1;
        for (size_t i = 0; i < sizeof aliases / sizeof aliases[0]; i++)
                if ((!strcmp(a, aliases[i][0]) && !strcmp(b, aliases[i][1])) ||
                    (!strcmp(a, aliases[i][1]) && !strcmp(b, aliases[i][0])))
                        return 1;
        return 0;
}

/* Where the user set librdkafka property `name` or an alias of it (e.g. the
 * variable's name), or NULL when only defaults set it. */
static const char *user_source(const struct config *cfg, const char *name) {
        const char *src = NULL;
        for (size_t i = 0; i < cfg->kafka_cnt; i++)
                if (same_property(cfg->kafka[i].name, name))
                        src = cfg->kafka[i].source;
        return src;
}

/* Builds the librdkafka configuration; NULL (errstr set) when it is bad. */
static rd_kafka_conf_t *build_conf(const struct config *cfg, char *errstr, size_t errstr_size) {
        rd_kafka_conf_t *conf = rd_kafka_conf_new();
        char features[512];
        size_t fsize = sizeof features;

        for (size_t i = 0; i < sizeof defaults / sizeof defaults[0]; i++)
                if (conf_set(conf, defaults[i][0], defaults[i][1], "default", errstr,
                             errstr_size) != 0)
                        goto fail;
        if (rd_kafka_conf_get(conf, "builtin.features", features, &fsize) == RD_KAFKA_CONF_OK &&
            strstr(features, "zstd") &&
            conf_set(conf, "compression.type", "zstd", "default", errstr, errstr_size) != 0)
                goto fail;
        /* The producer's queue holds one batch's messages at a time: sized
         * from OUTBOX_BATCH_BYTES (twice it: envelopes and headers add to
         * the rows' bytes) instead of librdkafka's 1 GiB, so the relay's
         * memory follows the byte budget (a full queue waits for acks). */
        char kb[24];
        snprintf(kb, sizeof kb, "%lld", cfg->batch_bytes / 1024 * 2 + 1024);
        if (conf_set(conf, "queue.buffering.max.kbytes", kb, "OUTBOX_BATCH_BYTES", errstr,
                     errstr_size) != 0)
                goto fail;
        for (size_t i = 0; i < cfg->kafka_cnt; i++)
                if (conf_set(conf, cfg->kafka[i].name, cfg->kafka[i].value, cfg->kafka[i].source,
                             errstr, errstr_size) != 0)
                        goto fail;
        /* zstd at level 1 unless told otherwise: librdkafka sets up a fresh
         * compression context for every message set without telling zstd its
         * size, and at the default level 3 zeroing that context's tables
         * costs more than compressing the few messages per partition a batch
         * holds. Level 1 roughly halves the relay's compression CPU for a
         * slightly larger output. */
        char v[32];
        size_t vs = sizeof v;
        if (!user_source(cfg, "compression.level") &&
            rd_kafka_conf_get(conf, "compression.type", v, &vs) == RD_KAFKA_CONF_OK &&
            strcmp(v, "zstd") == 0 &&
            conf_set(conf, "compression.level", "1", "default", errstr, errstr_size) != 0)
                goto fail;

        vs = sizeof v;
        if (rd_kafka_conf_get(conf, "enable.idempotence", v, &vs) != RD_KAFKA_CONF_OK ||
            strcmp(v, "true") != 0) {
                const char *src = user_source(cfg, "enable.idempotence");
                snprintf(errstr, errstr_size,
                         "%s: idempotence cannot be turned off (ordering and "
                         "at-least-once depend on it)",
                         src ? src : "enable.idempotence");
                goto fail;
        }
        return conf;
fail:
        rd_kafka_conf_destroy(conf);
        return NULL;
}

/* A lock must outlive the delivery of its batch (one delivery timeout, plus
 * the lock-ahead age and marking) by this much, or the sweeper takes back
 * rows that are still being delivered and they go out twice. */
#define LOCK_MARGIN_MS 30000

/* Settings librdkafka accepts that break the relay's guarantees. 0, or -1
 * with errstr naming the setting. */
static int check_guarantees(const struct config *cfg, rd_kafka_conf_t *conf, char *errstr,
                            size_t errstr_size) {
        /* value NULL: any non-empty value is refused */
        static const struct {
                const char *name, *value, *why;
        } refused[] = {
                {"transactional.id", NULL,
                 "transactional.id is not supported (the relay publishes with an idempotent, "
                 "non-transactional producer)"},
                {"partitioner", "random",
                 "partitioner=random spreads one aggregate over partitions and breaks "
                 "per-aggregate order"},
        };
        char v[64];
        size_t vs;
        const char *src;
        for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
                vs = sizeof v;
                if (rd_kafka_conf_get(conf, refused[i].name, v, &vs) != RD_KAFKA_CONF_OK || !*v ||
                    (refused[i].value && strcmp(v, refused[i].value)))
                        continue;
                src = user_source(cfg, refused[i].name);
                snprintf(errstr, errstr_size, "%s: %s", src ? src : refused[i].name,
                         refused[i].why);
                return -1;
        }
        vs = sizeof v;
        long long dt = 0;
        if (rd_kafka_conf_get(conf, "delivery.timeout.ms", v, &vs) == RD_KAFKA_CONF_OK)
                dt = atoll(v);
        if (dt + LOCK_MARGIN_MS > (long long)cfg->lock_timeout_s * 1000) {
                src = user_source(cfg, "delivery.timeout.ms");
                snprintf(errstr, errstr_size,
                         "%s: delivery.timeout.ms %lld plus %d s is not below "
                         "OUTBOX_LOCK_TIMEOUT_S %d s: the sweeper would take back rows still "
                         "being delivered (lower the delivery timeout, or raise "
                         "OUTBOX_LOCK_TIMEOUT_S for the relay and the sweeper)",
                         src ? src : "OUTBOX_LOCK_TIMEOUT_S", dt, LOCK_MARGIN_MS / 1000,
                         cfg->lock_timeout_s);
                return -1;
        }
        return 0;
}

static void quiet_log(const rd_kafka_t *rk, int level, const char *fac, const char *buf) {
        (void)rk, (void)level, (void)fac, (void)buf;
}

/* librdkafka checks its settings together only when a client is made: make
 * one that knows no broker (so it connects nowhere) and name the setting its
 * message blames (`acks`, `max.in.flight`, ...). 0 or -1 with errstr. */
static int check_with_librdkafka(const struct config *cfg, rd_kafka_conf_t *conf, char *errstr,
                                 size_t errstr_size) {
        char err[512];
        rd_kafka_conf_t *trial = rd_kafka_conf_dup(conf);
        rd_kafka_conf_set_log_cb(trial, quiet_log); /* the real producer logs its warnings */
        if (rd_kafka_conf_set(trial, "bootstrap.servers", "", err, sizeof err) !=
            RD_KAFKA_CONF_OK) {
                rd_kafka_conf_destroy(trial);
                snprintf(errstr, errstr_size, "%s", err);
                return -1;
        }
        rd_kafka_t *rk = rd_kafka_new(RD_KAFKA_PRODUCER, trial, err, sizeof err);
        if (rk) {
                rd_kafka_destroy(rk);
                return 0;
        }
        rd_kafka_conf_destroy(trial);
        /* the setting the message names first, e.g. "`acks` must be ..." */
        const char *src = NULL, *tick = strchr(err, '`');
        while (tick && !src) {
                const char *end = strchr(tick + 1, '`');
                if (!end)
                        break;
                char name[128];
                snprintf(name, sizeof name, "%.*s", (int)(end - tick - 1), tick + 1);
                src = user_source(cfg, name);
                tick = strchr(end + 1, '`');
        }
        snprintf(errstr, errstr_size, "%s: %s", src ? src : "OUTBOX_KAFKA_*", err);
        return -1;
}

int kafka_conf_check(const struct config *cfg, char *errstr, size_t errstr_size) {
        rd_kafka_conf_t *conf = build_conf(cfg, errstr, errstr_size);
        if (!conf)
                return -1;
        int rc = check_guarantees(cfg, conf, errstr, errstr_size) == 0 &&
                                 check_with_librdkafka(cfg, conf, errstr, errstr_size) == 0
                         ? 0
                         : -1;
        rd_kafka_conf_destroy(conf);
        return rc;
}

int kafka_conf_get(const struct config *cfg, const char *name, char *out, size_t out_size,
                   char *errstr, size_t errstr_size) {
        rd_kafka_conf_t *conf = build_conf(cfg, errstr, errstr_size);
        if (!conf)
                return -1;
        size_t size = out_size;
        int rc = 0;
        if (rd_kafka_conf_get(conf, name, out, &size) != RD_KAFKA_CONF_OK) {
                snprintf(errstr, errstr_size, "%s: unknown property or value too long", name);
                rc = -1;
        }
        rd_kafka_conf_destroy(conf);
        return rc;
}

/* Frees what kafka_new() made around the producer: the wake-up pipe, the
 * known topics, the handle. */
static void free_handle(struct kafka *k) {
        for (int i = 0; i < 2; i++)
                if (k->wake[i] >= 0)
                        close(k->wake[i]);
        for (size_t i = 0; k->known && i < KNOWN_TOPICS_MAX * 2; i++)
                free(k->known[i]);
        free(k->known);
        free(k);
}

struct kafka *kafka_new(const struct config *cfg, kafka_delivery_cb *cb, kafka_stats_cb *stats,
                        void *ctx, char *errstr, size_t errstr_size) {
        struct kafka *k = calloc(1, sizeof *k);
        if (!k) {
                snprintf(errstr, errstr_size, "out of memory");
                return NULL;
        }
        k->wake[0] = k->wake[1] = -1;
        rd_kafka_conf_t *conf = build_conf(cfg, errstr, errstr_size);
        if (!conf) {
                free(k);
                return NULL;
        }
        char v[32];
        size_t vs = sizeof v;
        k->delivery_timeout_ms = 120000;
        if (rd_kafka_conf_get(conf, "delivery.timeout.ms", v, &vs) == RD_KAFKA_CONF_OK)
                k->delivery_timeout_ms = atoi(v);
        vs = sizeof v;
        k->max_message_bytes = 1000000;
        if (rd_kafka_conf_get(conf, "message.max.bytes", v, &vs) == RD_KAFKA_CONF_OK)
                k->max_message_bytes = atoll(v);
        k->cb = cb;
        k->stats_cb = stats;
        k->ctx = ctx;
        rd_kafka_conf_set_opaque(conf, k);
        rd_kafka_conf_set_dr_msg_cb(conf, on_delivery);
        rd_kafka_conf_set_error_cb(conf, on_error);
        rd_kafka_conf_set_log_cb(conf, on_log);
        rd_kafka_conf_set_stats_cb(conf, on_stats);

        if (pipe(k->wake) != 0 || fcntl(k->wake[0], F_SETFL, O_NONBLOCK) != 0 ||
            fcntl(k->wake[1], F_SETFL, O_NONBLOCK) != 0) {
                snprintf(errstr, errstr_size, "pipe: %s", strerror(errno));
                rd_kafka_conf_destroy(conf);
                goto fail;
        }
        k->rk = rd_kafka_new(RD_KAFKA_PRODUCER, conf, errstr, errstr_size);
        if (!k->rk) {
                rd_kafka_conf_destroy(conf);
                goto fail;
        }
        /* Delivery reports, errors and statistics wait on the main queue;
         * librdkafka writes a byte to the pipe whenever it has some, so the
         * relay's poll() wakes for them. */
        rd_kafka_queue_t *q = rd_kafka_queue_get_main(k->rk);
        rd_kafka_queue_io_event_enable(q, k->wake[1], "1", 1);
        rd_kafka_queue_destroy(q);
        return k;
fail:
        free_handle(k);
        return NULL;
}

int kafka_fd(const struct kafka *k) {
        return k->wake[0];
}

/* 1 if `topic` was seen before; else remembers it (while there is room). */
static int topic_seen(struct kafka *k, const char *topic) {
        const size_t slots = KNOWN_TOPICS_MAX * 2;
        if (!k->known && !(k->known = calloc(slots, sizeof *k->known)))
                return 1;
        size_t h = 14695981039346656037ULL;
        for (const char *p = topic; *p; p++)
                h = (h ^ (unsigned char)*p) * 1099511628211ULL;
        for (size_t i = h % slots;; i = (i + 1) % slots) {
                if (!k->known[i]) {
                        if (k->nknown >= KNOWN_TOPICS_MAX || !(k->known[i] = strdup(topic)))
                                return 1;
                        k->nknown++;
                        return 0;
                }
                if (!strcmp(k->known[i], topic))
                        return 1;
        }
}

int kafka_produce(struct kafka *k, const char *topic, const char *key, size_t key_len,
                  const void *value, size_t value_len, const struct encode_header *hdrs,
                  int hdr_cnt, void *opaque, struct kafka_result *res) {
        /* A message to a topic librdkafka does not know yet waits for its
         * one-second metadata refresh; a topic handle the application makes
         * asks for the topic's metadata at once (without waiting for it). */
        if (!topic_seen(k, topic)) {
                rd_kafka_topic_t *rkt = rd_kafka_topic_new(k->rk, topic, NULL);
                if (rkt)
                        rd_kafka_topic_destroy(rkt);
        }
        rd_kafka_headers_t *h = rd_kafka_headers_new((size_t)hdr_cnt);
        for (int i = 0; i < hdr_cnt; i++)
                rd_kafka_header_add(h, hdrs[i].name, -1, hdrs[i].value, (ssize_t)hdrs[i].value_len);
        rd_kafka_resp_err_t err =
                rd_kafka_producev(k->rk, RD_KAFKA_V_TOPIC(topic), RD_KAFKA_V_KEY(key, key_len),
                                  RD_KAFKA_V_VALUE((void *)value, value_len),
                                  RD_KAFKA_V_MSGFLAGS(RD_KAFKA_MSG_F_COPY), RD_KAFKA_V_HEADERS(h),
                                  RD_KAFKA_V_OPAQUE(opaque), RD_KAFKA_V_END);
        if (err == RD_KAFKA_RESP_ERR_NO_ERROR) {
                k->outstanding++;
                return 0;
        }
        rd_kafka_headers_destroy(h);
        if (err == RD_KAFKA_RESP_ERR__QUEUE_FULL)
                return KAFKA_FULL;
        fill_result(res, err);
        return -1;
}

void kafka_serve(struct kafka *k) {
        char drain[64];
        while (read(k->wake[0], drain, sizeof drain) > 0)
                ;
        rd_kafka_poll(k->rk, 0);
}

void kafka_purge(struct kafka *k) {
        log_warn("kafka", "delivery wait timed out, purging", "outstanding=%d", k->outstanding);
        rd_kafka_purge(k->rk, RD_KAFKA_PURGE_F_QUEUE | RD_KAFKA_PURGE_F_INFLIGHT);
}

int kafka_outstanding(const struct kafka *k) {
        return k->outstanding;
}

int kafka_fatal(struct kafka *k, char *errstr, size_t errstr_size) {
        return rd_kafka_fatal_error(k->rk, errstr, errstr_size) != RD_KAFKA_RESP_ERR_NO_ERROR;
}

int kafka_broker_up(const struct kafka *k) {
        return k->broker_up;
}

void kafka_set_broker_up(struct kafka *k, int up) {
        k->broker_up = up;
}

int kafka_delivery_timeout_ms(const struct kafka *k) {
        return k->delivery_timeout_ms;
}

long long kafka_max_message_bytes(const struct kafka *k) {
        return k->max_message_bytes;
}

void kafka_destroy(struct kafka *k) {
        if (!k)
                return;
        k->cb = NULL; /* the owner of the opaques may be gone */
        k->stats_cb = NULL;
        rd_kafka_purge(k->rk, RD_KAFKA_PURGE_F_QUEUE | RD_KAFKA_PURGE_F_INFLIGHT);
        rd_kafka_flush(k->rk, 1000);
        rd_kafka_destroy(k->rk);
        free_handle(k);
}
