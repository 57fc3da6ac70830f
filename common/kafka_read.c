/* kafka_read.c - reads a window of messages with librdkafka's simple
 * (legacy) consumer: explicit offsets per partition, no consumer group, so
 * it needs no group ACL and commits nothing. */
#include "kafka_read.h"

#include <librdkafka/rdkafka.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "log.h"

/* Why a partition was not read, at most this long. */
#define UNREAD_MAX 160

/* One partition to read: [start, end) by offset. */
struct part {
        size_t topic; /* index into topics */
        int32_t id;
        int32_t leader; /* broker id, from the metadata */
        int64_t start, end;
        /* the answers of its leader's lookups, by enum lookup */
        int64_t at[5];
        int answered[5];
        int scan;                /* read [low, high) and keep [from_ms, to_ms) */
        char unread[UNREAD_MAX]; /* why it could not be read; "" when it was */
};

/* The offsets asked of each leader, one ListOffsets request each (Kafka's
 * -2 and -1 are the low and high watermarks). Timestamp 0 is before any
 * message: a broker that looks offsets up by time answers a partition's
 * first offset for it. One that answers -1 for a partition holding messages
 * cannot (librdkafka's mock cluster), and its -1 for `from` would read as
 * "nothing that late". */
enum lookup { AT_LOW, AT_HIGH, AT_FROM, AT_TO, AT_ZERO };

struct kafka_reader {
        rd_kafka_t *rk;
        char **topics;
        rd_kafka_topic_t **rkts;
        int *found;
        size_t ntopics;
        struct part *parts;
        size_t nparts, cur;
        int started; /* parts[cur] is being consumed */
        rd_kafka_message_t *held;
        long long planned, read;
        long long from_ms, to_ms; /* the window: messages with other timestamps are skipped */
};

static void on_log(const rd_kafka_t *rk, int level, const char *fac, const char *buf) {
        (void)rk;
        /* librdkafka warns about every producer property the consumer does
         * not use (OUTBOX_KAFKA_* is the relay's producer configuration) */
        enum log_level l = !strcmp(fac, "CONFWARN") ? LOG_DEBUG
                           : level <= 3             ? LOG_ERROR
                           : level <= 4             ? LOG_WARN
                           : level <= 6             ? LOG_INFO
                                                    : LOG_DEBUG;
        if (log_enabled(l))
                log_write(l, "kafka", "librdkafka", "fac=%s text=%s", fac, buf);
}

struct kafka_reader *kafka_reader_new(const struct config *cfg, int queued_kbytes, char *errstr,
                                      size_t errstr_size) {
        char err[512], kb[16];
        struct kafka_reader *r = calloc(1, sizeof *r);
        rd_kafka_conf_t *conf = rd_kafka_conf_new();
        if (!r || !conf) {
                snprintf(errstr, errstr_size, "out of memory");
                goto fail;
        }
        snprintf(kb, sizeof kb, "%d", queued_kbytes);
        /* ours first, so the operator's properties win */
        const char *const ours[][2] = {{"client.id", "outboxctl"},
                                       {"queued.max.messages.kbytes", kb},
                                       {"enable.partition.eof", "true"},
                                       {"auto.offset.reset", "earliest"}};
        for (size_t i = 0; i < sizeof ours / sizeof ours[0]; i++)
                if (rd_kafka_conf_set(conf, ours[i][0], ours[i][1], err, sizeof err) !=
                    RD_KAFKA_CONF_OK) {
                        snprintf(errstr, errstr_size, "%s: %s", ours[i][0], err);
                        goto fail;
                }
        for (size_t i = 0; i < cfg->kafka_cnt; i++)
                if (rd_kafka_conf_set(conf, cfg->kafka[i].name, cfg->kafka[i].value, err,
                                      sizeof err) != RD_KAFKA_CONF_OK) {
                        snprintf(errstr, errstr_size, "%s: %s", cfg->kafka[i].source, err);
                        goto fail;
                }
        rd_kafka_conf_set_log_cb(conf, on_log);
        r->rk = rd_kafka_new(RD_KAFKA_CONSUMER, conf, errstr, errstr_size);
        if (!r->rk)
                goto fail;
        return r;
fail:
        if (conf)
                rd_kafka_conf_destroy(conf);
        free(r);
        return NULL;
}

/* Partition ids of topic i into r->parts; sets found[i]. */
static int add_partitions(struct kafka_reader *r, size_t i, int timeout_ms, char *errstr,
                          size_t size) {
        const struct rd_kafka_metadata *md = NULL;
        rd_kafka_resp_err_t err = rd_kafka_metadata(r->rk, 0, r->rkts[i], &md, timeout_ms);
        if (err) {
                snprintf(errstr, size, "metadata of %s: %s", r->topics[i], rd_kafka_err2str(err));
                return -1;
        }
        int rc = 0;
        const struct rd_kafka_metadata_topic *t = md->topic_cnt == 1 ? &md->topics[0] : NULL;
        if (t && t->err == RD_KAFKA_RESP_ERR_NO_ERROR && t->partition_cnt > 0) {
                struct part *p =
                        realloc(r->parts, (r->nparts + (size_t)t->partition_cnt) * sizeof *p);
                if (!p) {
                        snprintf(errstr, size, "out of memory");
                        rc = -1;
                } else {
                        r->parts = p;
                        for (int k = 0; k < t->partition_cnt; k++)
                                r->parts[r->nparts++] =
                                        (struct part){.topic = i,
                                                      .id = t->partitions[k].id,
                                                      .leader = t->partitions[k].leader};
                        r->found[i] = 1;
                }
        } else if (t && t->err != RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART &&
                   t->err != RD_KAFKA_RESP_ERR_NO_ERROR) {
                snprintf(errstr, size, "metadata of %s: %s", r->topics[i],
                         rd_kafka_err2str(t->err));
                rc = -1;
        }
        rd_kafka_metadata_destroy(md);
        return rc;
}

static int by_topic_partition(const void *a, const void *b) {
        const struct part *x = a, *y = b;
        if (x->topic != y->topic)
                return x->topic < y->topic ? -1 : 1;
        return (x->id > y->id) - (x->id < y->id);
}

/* Marks partition p unread, for `why` (printf-style). Logged once. */
static void set_unread(struct kafka_reader *r, struct part *p, const char *fmt, ...)
        __attribute__((format(printf, 3, 4)));
static void set_unread(struct kafka_reader *r, struct part *p, const char *fmt, ...) {
        va_list ap;
        if (*p->unread)
                return;
        va_start(ap, fmt);
        vsnprintf(p->unread, sizeof p->unread, fmt, ap);
        va_end(ap);
        log_warn("kafka", "partition not read: cannot tell what it holds",
                 "topic=%s partition=%d err=%s", r->topics[p->topic], (int)p->id, p->unread);
}

/* Asks the leader of parts[first..last) (one broker) for each lookup's
 * offsets. A request that fails as a whole (the broker does not answer within
 * timeout_ms) leaves its answers missing: missing watermarks make the
 * partitions unread, missing times make them scanned. */
static void lookups(struct kafka_reader *r, size_t first, size_t last, int timeout_ms) {
        const long long ts[] = {[AT_LOW] = -2,
                                [AT_HIGH] = -1,
                                [AT_FROM] = r->from_ms,
                                [AT_TO] = r->to_ms,
                                [AT_ZERO] = 0};
        for (int k = 0; k < 5; k++) {
                rd_kafka_topic_partition_list_t *l =
                        rd_kafka_topic_partition_list_new((int)(last - first));
                for (size_t i = first; i < last; i++)
                        rd_kafka_topic_partition_list_add(l, r->topics[r->parts[i].topic],
                                                          r->parts[i].id)
                                ->offset = ts[k];
                rd_kafka_resp_err_t err = rd_kafka_offsets_for_times(r->rk, l, timeout_ms);
                for (size_t i = first; i < last; i++) {
                        struct part *p = &r->parts[i];
                        rd_kafka_topic_partition_t *e =
                                err ? NULL
                                    : rd_kafka_topic_partition_list_find(l, r->topics[p->topic],
                                                                         p->id);
                        if (e && !e->err) {
                                p->at[k] = e->offset;
                                p->answered[k] = 1;
                        } else if (k <= AT_HIGH) {
                                rd_kafka_resp_err_t why = err ? err
                                                          : e ? e->err
                                                              : RD_KAFKA_RESP_ERR__FAIL;
                                set_unread(r, p, "leader %d: watermarks: %s", (int)p->leader,
                                           rd_kafka_err2str(why));
                        }
                }
                rd_kafka_topic_partition_list_destroy(l);
                if (err)
                        log_info("kafka", "offsets lookup failed", "leader=%d lookup=%d err=%s",
                                 (int)r->parts[first].leader, k, rd_kafka_err2str(err));
                /* a leader that did not answer is not asked again */
                if (err == RD_KAFKA_RESP_ERR__TIMED_OUT || err == RD_KAFKA_RESP_ERR__TRANSPORT)
                        break;
        }
}

static int by_leader(const void *a, const void *b) {
        const struct part *x = a, *y = b;
        if (x->leader != y->leader)
                return (x->leader > y->leader) - (x->leader < y->leader);
        return by_topic_partition(a, b);
}

int kafka_reader_plan(struct kafka_reader *r, const char *const *topics, size_t n,
                      long long from_ms, long long to_ms, int timeout_ms, char *errstr,
                      size_t errstr_size) {
        r->topics = calloc(n + 1, sizeof *r->topics);
        r->rkts = calloc(n + 1, sizeof *r->rkts);
        r->found = calloc(n + 1, sizeof *r->found);
        r->from_ms = from_ms;
        r->to_ms = to_ms;
        if (!r->topics || !r->rkts || !r->found) {
                snprintf(errstr, errstr_size, "out of memory");
                return -1;
        }
        for (size_t i = 0; i < n; i++) {
                r->ntopics++;
                r->topics[i] = strdup(topics[i]);
                r->rkts[i] = r->topics[i] ? rd_kafka_topic_new(r->rk, topics[i], NULL) : NULL;
                if (!r->rkts[i]) {
                        snprintf(errstr, errstr_size, "topic %s: %s", topics[i],
                                 r->topics[i] ? rd_kafka_err2str(rd_kafka_last_error())
                                              : "out of memory");
                        return -1;
                }
                if (add_partitions(r, i, timeout_ms, errstr, errstr_size) != 0)
                        return -1;
        }
        if (!r->nparts)
                return 0;
        /* one set of lookups per leader: a broker that is down costs one
         * timeout, and holds up only its own partitions */
        qsort(r->parts, r->nparts, sizeof *r->parts, by_leader);
        for (size_t first = 0, last; first < r->nparts; first = last) {
                for (last = first + 1;
                     last < r->nparts && r->parts[last].leader == r->parts[first].leader; last++)
                        ;
                lookups(r, first, last, timeout_ms);
        }
        qsort(r->parts, r->nparts, sizeof *r->parts, by_topic_partition);
        for (size_t i = 0; i < r->nparts; i++) {
                struct part *p = &r->parts[i];
                if (*p->unread)
                        continue;
                int64_t lo = p->at[AT_LOW], hi = p->at[AT_HIGH];
                int by_time = p->answered[AT_FROM] && p->answered[AT_TO] && p->answered[AT_ZERO] &&
                              (hi <= lo || p->at[AT_ZERO] >= 0);
                if (!by_time) {
                        p->scan = 1;
                        p->start = lo;
                        p->end = hi;
                } else {
                        p->start = p->at[AT_FROM];
                        p->end = p->at[AT_TO];
                        if (p->end < 0 || p->end > hi)
                                p->end = hi;
                        if (p->start < 0 || p->start > p->end) /* nothing that late */
                                p->start = p->end;
                        if (p->start < lo)
                                p->start = lo;
                }
                if (p->end > p->start)
                        r->planned += p->end - p->start;
        }
        return 0;
}

int kafka_reader_topic_found(const struct kafka_reader *r, size_t i) {
        return i < r->ntopics && r->found[i];
}

void kafka_reader_progress(const struct kafka_reader *r, int *partitions, long long *planned,
                           long long *read) {
        *partitions = (int)r->nparts;
        *planned = r->planned;
        *read = r->read;
}

size_t kafka_reader_partitions(const struct kafka_reader *r) {
        return r->nparts;
}

void kafka_reader_partition(const struct kafka_reader *r, size_t i, struct kafka_read_part *out) {
        const struct part *p = &r->parts[i];
        out->topic = r->topics[p->topic];
        out->partition = (int)p->id;
        out->scanned = p->scan;
        out->unread = *p->unread ? p->unread : NULL;
}

/* The header `name` of m into *v, *len (NULL when absent). */
static void header(rd_kafka_headers_t *h, const char *name, const char **v, size_t *len) {
        const void *val = NULL;
        size_t size = 0;
        *v = NULL;
        *len = 0;
        if (h && rd_kafka_header_get_last(h, name, &val, &size) == RD_KAFKA_RESP_ERR_NO_ERROR &&
            val) {
                *v = val;
                *len = size;
        }
}

static void stop_current(struct kafka_reader *r) {
        if (r->started) {
                struct part *p = &r->parts[r->cur];
                rd_kafka_consume_stop(r->rkts[p->topic], p->id);
                r->started = 0;
        }
        r->cur++;
}

int kafka_reader_next(struct kafka_reader *r, struct kafka_read_msg *m, int idle_ms) {
        if (r->held) {
                rd_kafka_message_destroy(r->held);
                r->held = NULL;
        }
        while (r->cur < r->nparts) {
                struct part *p = &r->parts[r->cur];
                rd_kafka_topic_t *rkt = r->rkts[p->topic];
                if (p->start >= p->end) {
                        stop_current(r);
                        continue;
                }
                if (*p->unread) {
                        stop_current(r);
                        continue;
                }
                if (!r->started) {
                        if (rd_kafka_consume_start(rkt, p->id, p->start) != 0) {
                                set_unread(r, p, "read from offset %lld: %s", (long long)p->start,
                                           rd_kafka_err2str(rd_kafka_last_error()));
                                r->cur++;
                                continue;
                        }
                        r->started = 1;
                }
                double deadline = clock_mono_s() + idle_ms / 1000.0;
                rd_kafka_message_t *msg = NULL;
                while (!msg && clock_mono_s() <= deadline)
                        msg = rd_kafka_consume(rkt, p->id, 200);
                if (!msg) {
                        set_unread(r, p, "nothing for %d ms at offset %lld (reading up to %lld)",
                                   idle_ms, (long long)p->start, (long long)p->end);
                        stop_current(r);
                        continue;
                }
                if (msg->err == RD_KAFKA_RESP_ERR__PARTITION_EOF) {
                        rd_kafka_message_destroy(msg);
                        stop_current(r); /* the end moved back (deleted?): nothing more */
                        continue;
                }
                if (msg->err) {
                        set_unread(r, p, "%s at offset %lld", rd_kafka_message_errstr(msg),
                                   (long long)p->start);
                        rd_kafka_message_destroy(msg);
                        stop_current(r);
                        continue;
                }
                if (msg->offset >= p->end) {
                        rd_kafka_message_destroy(msg);
                        stop_current(r);
                        continue;
                }
                p->start = msg->offset + 1;
                if (p->start >= p->end)
                        stop_current(r);
                rd_kafka_timestamp_type_t tstype;
                long long ts = rd_kafka_message_timestamp(msg, &tstype);
                /* only the window's messages (and those without a
                 * timestamp: they cannot be placed); a partition's offsets
                 * are not in timestamp order (a producer sets CreateTime) */
                if (tstype != RD_KAFKA_TIMESTAMP_NOT_AVAILABLE &&
                    (ts < r->from_ms || ts >= r->to_ms)) {
                        rd_kafka_message_destroy(msg);
                        continue;
                }
                r->held = msg;
                r->read++;
                memset(m, 0, sizeof *m);
                m->topic = r->topics[p->topic];
                m->partition = msg->partition;
                m->offset = msg->offset;
                m->timestamp_ms = ts;
                rd_kafka_headers_t *h = NULL;
                if (rd_kafka_message_headers(msg, &h) != RD_KAFKA_RESP_ERR_NO_ERROR)
                        h = NULL;
                header(h, "event-id", &m->event_id, &m->event_id_len);
                header(h, "tenant-id", &m->tenant_id, &m->tenant_id_len);
                header(h, "aggregate-type", &m->aggregate_type, &m->aggregate_type_len);
                header(h, "aggregate-id", &m->aggregate_id, &m->aggregate_id_len);
                header(h, "aggregate-version", &m->aggregate_version, &m->aggregate_version_len);
                return 1;
        }
        return 0;
}

void kafka_reader_destroy(struct kafka_reader *r) {
        if (!r)
                return;
        if (r->held)
                rd_kafka_message_destroy(r->held);
        if (r->started && r->cur < r->nparts)
                rd_kafka_consume_stop(r->rkts[r->parts[r->cur].topic], r->parts[r->cur].id);
        for (size_t i = 0; i < r->ntopics; i++) {
                if (r->rkts && r->rkts[i])
                        rd_kafka_topic_destroy(r->rkts[i]);
                free(r->topics[i]);
        }

        free(r->topics);
        free(r->rkts);
        free(r->found);
        free(r->parts);
        if (r->rk)
                rd_kafka_destroy(r->rk);
        free(r);
}
