/* kafka.c - librdkafka idempotent producer with delivery reports. */
#define _GNU_SOURCE /* RTLD_NEXT */
#include "kafka.h"

#include <dlfcn.h>
#include <librdkafka/rdkafka.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "log.h"

struct kafka {
        rd_kafka_t *rk;
        kafka_delivery_cb *cb;
        void *ctx;
        int outstanding;
        int delivery_timeout_ms;
        int broker_up;
        double last_probe;
};

/* DESIGN.md's producer defaults; anything may be overridden but idempotence. */
static const char *const defaults[][2] = {
        {"acks", "all"},
        {"enable.idempotence", "true"},
        {"max.in.flight.requests.per.connection", "5"},
        {"linger.ms", "5"},
        {"batch.size", "32768"},
        {"delivery.timeout.ms", "120000"},
        {"socket.nagle.disable", "true"},
        {"client.id", "outbox-relay"},
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

/* Where the user set librdkafka property `name` (e.g. the variable's name),
 * or NULL when only defaults set it. */
static const char *user_source(const struct config *cfg, const char *name) {
        const char *src = NULL;
        for (size_t i = 0; i < cfg->kafka_cnt; i++)
                if (strcmp(cfg->kafka[i].name, name) == 0)
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

int kafka_conf_check(const struct config *cfg, char *errstr, size_t errstr_size) {
        rd_kafka_conf_t *conf = build_conf(cfg, errstr, errstr_size);
        if (!conf)
                return -1;
        rd_kafka_conf_destroy(conf);
        return 0;
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

struct kafka *kafka_new(const struct config *cfg, kafka_delivery_cb *cb, void *ctx, char *errstr,
                        size_t errstr_size) {
        struct kafka *k = calloc(1, sizeof *k);
        if (!k) {
                snprintf(errstr, errstr_size, "out of memory");
                return NULL;
        }
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
        k->cb = cb;
        k->ctx = ctx;
        rd_kafka_conf_set_opaque(conf, k);
        rd_kafka_conf_set_dr_msg_cb(conf, on_delivery);
        rd_kafka_conf_set_error_cb(conf, on_error);
        rd_kafka_conf_set_log_cb(conf, on_log);

        k->rk = rd_kafka_new(RD_KAFKA_PRODUCER, conf, errstr, errstr_size);
        if (!k->rk) {
                rd_kafka_conf_destroy(conf);
                free(k);
                return NULL;
        }
        k->broker_up = 0;
        return k;
}

int kafka_produce(struct kafka *k, const char *topic, const char *key, size_t key_len,
                  const void *value, size_t value_len, const struct encode_header *hdrs,
                  int hdr_cnt, void *opaque, struct kafka_result *res) {
        double deadline = clock_mono_s() + k->delivery_timeout_ms / 1000.0;
        for (;;) {
                rd_kafka_headers_t *h = rd_kafka_headers_new((size_t)hdr_cnt);
                for (int i = 0; i < hdr_cnt; i++)
                        rd_kafka_header_add(h, hdrs[i].name, -1, hdrs[i].value,
                                            (ssize_t)hdrs[i].value_len);
                rd_kafka_resp_err_t err = rd_kafka_producev(
                        k->rk, RD_KAFKA_V_TOPIC(topic), RD_KAFKA_V_KEY(key, key_len),
                        RD_KAFKA_V_VALUE((void *)value, value_len),
                        RD_KAFKA_V_MSGFLAGS(RD_KAFKA_MSG_F_COPY), RD_KAFKA_V_HEADERS(h),
                        RD_KAFKA_V_OPAQUE(opaque), RD_KAFKA_V_END);
                if (err == RD_KAFKA_RESP_ERR_NO_ERROR) {
                        k->outstanding++;
                        return 0;
                }
                rd_kafka_headers_destroy(h);
                if (err == RD_KAFKA_RESP_ERR__QUEUE_FULL && clock_mono_s() < deadline) {
                        rd_kafka_poll(k->rk, 100);
                        continue;
                }
                fill_result(res, err);
                return -1;
        }
}

void kafka_poll(struct kafka *k, int timeout_ms) {
        rd_kafka_poll(k->rk, timeout_ms);
}

void kafka_wait(struct kafka *k, int timeout_ms, int (*tick)(void *), void *arg) {
        double deadline = clock_mono_s() + timeout_ms / 1000.0;
        while (k->outstanding > 0) {
                double left = deadline - clock_mono_s();
                double slice = tick ? KAFKA_TICK_MS / 1000.0 : 0.5;
                if (left <= 0)
                        break;
                /* flush sends at once, ignoring linger.ms, and serves callbacks */
                rd_kafka_flush(k->rk, (int)((left > slice ? slice : left) * 1000) + 1);
                if (tick && !tick(arg))
                        tick = NULL;
        }
        if (k->outstanding > 0) {
                log_warn("kafka", "delivery wait timed out, purging", "outstanding=%d",
                         k->outstanding);
                rd_kafka_purge(k->rk, RD_KAFKA_PURGE_F_QUEUE | RD_KAFKA_PURGE_F_INFLIGHT);
                for (int i = 0; i < 100 && k->outstanding > 0; i++)
                        rd_kafka_poll(k->rk, 50);
        }
}

int kafka_outstanding(struct kafka *k) {
        return k->outstanding;
}

int kafka_fatal(struct kafka *k, char *errstr, size_t errstr_size) {
        return rd_kafka_fatal_error(k->rk, errstr, errstr_size) != RD_KAFKA_RESP_ERR_NO_ERROR;
}

int kafka_broker_up(struct kafka *k) {
        double t = clock_mono_s();
        if (!k->broker_up && t - k->last_probe >= 1.0) {
                const struct rd_kafka_metadata *md = NULL;
                k->last_probe = t;
                if (rd_kafka_metadata(k->rk, 0, NULL, &md, 500) == RD_KAFKA_RESP_ERR_NO_ERROR) {
                        k->broker_up = md->broker_cnt > 0;
                        rd_kafka_metadata_destroy(md);
                }
        }
        return k->broker_up;
}

int kafka_delivery_timeout_ms(const struct kafka *k) {
        return k->delivery_timeout_ms;
}

void kafka_destroy(struct kafka *k) {
        if (!k)
                return;
        k->cb = NULL; /* the owner of the opaques may be gone */
        rd_kafka_purge(k->rk, RD_KAFKA_PURGE_F_QUEUE | RD_KAFKA_PURGE_F_INFLIGHT);
        rd_kafka_flush(k->rk, 1000);
        rd_kafka_destroy(k->rk);
        free(k);
}

/* One zstd compression context per librdkafka thread, reused.
 *
 * librdkafka (2.0) compresses every message set with a context of its own:
 * ZSTD_createCStream(), compress, ZSTD_freeCStream(). A batch spread over 64
 * partitions is 64 message sets of a few messages each, so creating the
 * context costs about as much as compressing: zstd allocates and zeroes its
 * workspace and probes the CPU with `cpuid`, which a virtual machine traps
 * (1-2 % of all CPU in the benchmark's relay run, tests/bench/RESULTS.md).
 *
 * The kafka module defines the two functions itself; the dynamic linker binds
 * librdkafka's calls to the executable's definitions first (this file holds
 * kafka_new(), so every program that produces links them;
 * tests/integration/test_relay.py checks the binding). A freed context is
 * reset (session and parameters: as good as new) and kept for the thread's
 * next message set; a second one is really freed; a thread's kept context is
 * freed when the thread exits. Nothing changes in what is compressed. Without
 * zstd in the process (librdkafka built without it) librdkafka never calls
 * them.
 *
 * Declared here rather than through <zstd.h>, whose package the build does not
 * otherwise need; these are zstd's stable API (1.4.0 on). */
typedef struct ZSTD_CCtx_s ZSTD_CStream;
enum { ZSTD_RESET_SESSION_AND_PARAMETERS = 3 };

ZSTD_CStream *ZSTD_createCStream(void);
size_t ZSTD_freeCStream(ZSTD_CStream *zcs);

static ZSTD_CStream *(*zstd_real_create)(void);
static size_t (*zstd_real_free)(ZSTD_CStream *);
static size_t (*zstd_reset)(ZSTD_CStream *, int);
static pthread_key_t zstd_kept;
static int zstd_usable; /* the real functions were found and the key made */
static pthread_once_t zstd_once = PTHREAD_ONCE_INIT;

static void zstd_free_kept(void *zcs) {
        zstd_real_free(zcs);
}

static void zstd_init(void) {
        zstd_real_create = (ZSTD_CStream * (*)(void)) dlsym(RTLD_NEXT, "ZSTD_createCStream");
        zstd_real_free = (size_t(*)(ZSTD_CStream *))dlsym(RTLD_NEXT, "ZSTD_freeCStream");
        zstd_reset = (size_t(*)(ZSTD_CStream *, int))dlsym(RTLD_NEXT, "ZSTD_CCtx_reset");
        zstd_usable = zstd_real_create && zstd_real_free && zstd_reset &&
                      pthread_key_create(&zstd_kept, zstd_free_kept) == 0;
}

ZSTD_CStream *ZSTD_createCStream(void) {
        pthread_once(&zstd_once, zstd_init);
        if (!zstd_real_create)
                return NULL; /* no zstd loaded: the caller reports a compression error */
        if (zstd_usable) {
                ZSTD_CStream *zcs = pthread_getspecific(zstd_kept);
                if (zcs) {
                        pthread_setspecific(zstd_kept, NULL);
                        return zcs;
                }
        }
        return zstd_real_create();
}

size_t ZSTD_freeCStream(ZSTD_CStream *zcs) {
        pthread_once(&zstd_once, zstd_init);
        if (!zcs || !zstd_real_free)
                return 0;
        /* ZSTD_CCtx_reset() returns 0 on success, an error code otherwise */
        if (zstd_usable && !pthread_getspecific(zstd_kept) &&
            zstd_reset(zcs, ZSTD_RESET_SESSION_AND_PARAMETERS) == 0 &&
            pthread_setspecific(zstd_kept, zcs) == 0)
                return 0;
        return zstd_real_free(zcs);
}
