/* kafka_read.c - reads a window of messages with librdkafka's simple
 * (legacy) consumer: explicit offsets per partition, no consumer group, so
 * it needs no group ACL and commits nothing. */
#include "kafka_read.h"

#include <librdkafka/rdkafka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "log.h"

/* One partition to read: [start, end) by offset. */
struct part {
        size_t topic; /* index into topics */
        int32_t id;
        int64_t start, end;
};

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
                                r->parts[r->nparts++] = (struct part){i, t->partitions[k].id, 0, 0};
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

/* Offsets for one timestamp of every planned partition (-1: none that late),
 * into start (which = 0) or end (1). */
static int offsets_at(struct kafka_reader *r, long long ts_ms, int which, int timeout_ms,
                      char *errstr, size_t size) {
        rd_kafka_topic_partition_list_t *l = rd_kafka_topic_partition_list_new((int)r->nparts);
        for (size_t i = 0; i < r->nparts; i++)
                rd_kafka_topic_partition_list_add(l, r->topics[r->parts[i].topic], r->parts[i].id)
                        ->offset = ts_ms;
        rd_kafka_resp_err_t err = rd_kafka_offsets_for_times(r->rk, l, timeout_ms);
        int rc = 0;
        if (err) {
                snprintf(errstr, size, "offsets for times: %s", rd_kafka_err2str(err));
                rc = -1;
        }
        for (size_t i = 0; rc == 0 && i < r->nparts; i++) {
                struct part *p = &r->parts[i];
                rd_kafka_topic_partition_t *e =
                        rd_kafka_topic_partition_list_find(l, r->topics[p->topic], p->id);
                if (!e || e->err) {
                        snprintf(errstr, size, "offsets for times of %s[%d]: %s",
                                 r->topics[p->topic], p->id,
                                 e ? rd_kafka_err2str(e->err) : "no answer");
                        rc = -1;
                        break;
                }
                *(which ? &p->end : &p->start) = e->offset;
        }
        rd_kafka_topic_partition_list_destroy(l);
        return rc;
}

int kafka_reader_plan(struct kafka_reader *r, const char *const *topics, size_t n,
                      long long from_ms, long long to_ms, int timeout_ms, char *errstr,
                      size_t errstr_size) {
        r->topics = calloc(n + 1, sizeof *r->topics);
        r->rkts = calloc(n + 1, sizeof *r->rkts);
        r->found = calloc(n + 1, sizeof *r->found);
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
        qsort(r->parts, r->nparts, sizeof *r->parts, by_topic_partition);
        if (offsets_at(r, from_ms, 0, timeout_ms, errstr, errstr_size) != 0 ||
            offsets_at(r, to_ms, 1, timeout_ms, errstr, errstr_size) != 0)
                return -1;
        for (size_t i = 0; i < r->nparts; i++) {
                struct part *p = &r->parts[i];
                int64_t lo, hi;
                rd_kafka_resp_err_t err = rd_kafka_query_watermark_offsets(
                        r->rk, r->topics[p->topic], p->id, &lo, &hi, timeout_ms);
                if (err) {
                        snprintf(errstr, errstr_size, "watermarks of %s[%d]: %s",
                                 r->topics[p->topic], p->id, rd_kafka_err2str(err));
                        return -1;
                }
                if (p->end < 0 || p->end > hi)
                        p->end = hi;
                if (p->start < 0 || p->start > p->end) /* nothing that late */
                        p->start = p->end;
                if (p->start < lo)
                        p->start = lo;
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

int kafka_reader_next(struct kafka_reader *r, struct kafka_read_msg *m, int idle_ms, char *errstr,
                      size_t errstr_size) {
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
                if (!r->started) {
                        if (rd_kafka_consume_start(rkt, p->id, p->start) != 0) {
                                snprintf(errstr, errstr_size, "read %s[%d] from offset %lld: %s",
                                         r->topics[p->topic], p->id, (long long)p->start,
                                         rd_kafka_err2str(rd_kafka_last_error()));
                                return -1;
                        }
                        r->started = 1;
                }
                double deadline = clock_mono_s() + idle_ms / 1000.0;
                rd_kafka_message_t *msg = NULL;
                while (!msg) {
                        msg = rd_kafka_consume(rkt, p->id, 200);
                        if (!msg && clock_mono_s() > deadline) {
                                snprintf(errstr, errstr_size,
                                         "read %s[%d]: nothing for %d ms at offset %lld (reading "
                                         "up to %lld)",
                                         r->topics[p->topic], p->id, idle_ms, (long long)p->start,
                                         (long long)p->end);
                                return -1;
                        }
                }
                if (msg->err == RD_KAFKA_RESP_ERR__PARTITION_EOF) {
                        rd_kafka_message_destroy(msg);
                        stop_current(r); /* the end moved back (deleted?): nothing more */
                        continue;
                }
                if (msg->err) {
                        snprintf(errstr, errstr_size, "read %s[%d]: %s", r->topics[p->topic], p->id,
                                 rd_kafka_message_errstr(msg));
                        rd_kafka_message_destroy(msg);
                        return -1;
                }
                if (msg->offset >= p->end) {
                        rd_kafka_message_destroy(msg);
                        stop_current(r);
                        continue;
                }
                p->start = msg->offset + 1;
                if (p->start >= p->end)
                        stop_current(r);
                r->held = msg;
                r->read++;
                memset(m, 0, sizeof *m);
                m->topic = r->topics[p->topic];
                m->partition = msg->partition;
                m->offset = msg->offset;
                rd_kafka_timestamp_type_t tstype;
                m->timestamp_ms = rd_kafka_message_timestamp(msg, &tstype);
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
