/* kafka_stats.c - librdkafka statistics JSON -> struct kafka_stats -> metrics.
 * Parsed with jansson (a DOM of the whole document: statistics come every
 * statistics.interval.ms, 15 s by default, so simplicity wins over speed). */
#include "kafka_stats.h"

#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "errstr.h"
#include "metrics.h"

/* A non-negative count from a JSON number; anything else (missing, a string,
 * negative, NaN) reads 0, and reals beyond long long saturate. */
static long long count_of(const json_t *v) {
        if (json_is_integer(v)) {
                json_int_t i = json_integer_value(v);
                return i > 0 ? (long long)i : 0;
        }
        if (json_is_real(v)) {
                double d = json_real_value(v);
                if (!(d > 0))
                        return 0;
                return d >= 9.2e18 ? LLONG_MAX : (long long)d;
        }
        return 0;
}

static long long add_sat(long long a, long long b) {
        return a > LLONG_MAX - b ? LLONG_MAX : a + b;
}

static long long member_count(const json_t *obj, const char *key) {
        return count_of(json_object_get(obj, key));
}

static int broker_cmp(const void *a, const void *b) {
        const struct kafka_stats_broker *x = a, *y = b;
        return (x->id > y->id) - (x->id < y->id);
}

/* The node id of a broker entry that names a real broker, else -1. */
static int real_node_id(const json_t *b) {
        const json_t *id = json_object_get(b, "nodeid");
        if (!json_is_integer(id) || json_integer_value(id) < 0 || json_integer_value(id) > INT_MAX)
                return -1;
        const char *source = json_string_value(json_object_get(b, "source"));
        if (source && (!strcmp(source, "logical") || !strcmp(source, "internal")))
                return -1;
        return (int)json_integer_value(id);
}

/* Adds broker entry b to out (its counters to the totals, and, if it names a
 * real broker, to the list). */
static void add_broker(struct kafka_stats *out, const json_t *b) {
        out->retries = add_sat(out->retries, member_count(b, "txretries"));
        out->errors = add_sat(out->errors, member_count(b, "txerrs"));
        out->errors = add_sat(out->errors, member_count(b, "rxerrs"));
        out->errors = add_sat(out->errors, member_count(b, "req_timeouts"));

        int id = real_node_id(b);
        if (id < 0)
                return;
        const char *state = json_string_value(json_object_get(b, "state"));
        int up = state && !strcmp(state, "UP");
        /* p99 in microseconds; up to 2^63 us fits a double well enough */
        double rtt = (double)member_count(json_object_get(b, "rtt"), "p99") / 1e6;
        long long inflight = member_count(b, "waitresp_cnt");
        long long outbuf = member_count(b, "outbuf_msg_cnt");

        struct kafka_stats_broker *k = NULL;
        for (size_t i = 0; i < out->nbrokers && !k; i++)
                if (out->brokers[i].id == id)
                        k = &out->brokers[i];
        if (k) { /* one broker under two names: one connection's worth each */
                if (up && !k->up)
                        out->brokers_up++;
                k->up |= up;
                k->rtt_p99_s = fmax(k->rtt_p99_s, rtt);
                k->inflight = add_sat(k->inflight, inflight);
                k->outbuf = add_sat(k->outbuf, outbuf);
                return;
        }
        out->brokers_up += up;
        if (out->nbrokers >= KAFKA_STATS_MAX_BROKERS)
                return;
        k = &out->brokers[out->nbrokers++];
        k->id = id;
        k->up = up;
        k->rtt_p99_s = rtt;
        k->inflight = inflight;
        k->outbuf = outbuf;
}

int kafka_stats_parse(const char *json, size_t len, struct kafka_stats *out, char *errstr,
                      size_t errstr_size) {
        memset(out, 0, sizeof *out);
        json_error_t jerr;
        json_t *root = json_loadb(json, len, 0, &jerr);
        if (!root)
                return errstr_set(errstr, errstr_size, "statistics are not JSON: %s at %d",
                                  jerr.text, jerr.position);
        int rc = 0;
        if (!json_is_object(root)) {
                rc = errstr_set(errstr, errstr_size, "statistics are not a JSON object");
                goto out;
        }
        out->queue_messages = member_count(root, "msg_cnt");
        const json_t *brokers = json_object_get(root, "brokers");
        const char *name;
        json_t *b;
        json_object_foreach((json_t *)brokers, name, b) {
                if (json_is_object(b))
                        add_broker(out, b);
        }
        qsort(out->brokers, out->nbrokers, sizeof out->brokers[0], broker_cmp);
out:
        json_decref(root);
        return rc;
}

int kafka_stats_apply(const struct kafka_stats *s, struct kafka_stats_seen *seen) {
        size_t n = s->nbrokers < KAFKA_STATS_MAX_BROKERS ? s->nbrokers : KAFKA_STATS_MAX_BROKERS;
        char ids[KAFKA_STATS_MAX_BROKERS][12];
        const char *labels[KAFKA_STATS_MAX_BROKERS];
        double rtt[KAFKA_STATS_MAX_BROKERS], inflight[KAFKA_STATS_MAX_BROKERS],
                outbuf[KAFKA_STATS_MAX_BROKERS];
        for (size_t i = 0; i < n; i++) {
                snprintf(ids[i], sizeof ids[i], "%d", s->brokers[i].id);
                labels[i] = ids[i];
                rtt[i] = s->brokers[i].rtt_p99_s;
                inflight[i] = (double)s->brokers[i].inflight;
                outbuf[i] = (double)s->brokers[i].outbuf;
        }
        int rc = 0;
        if (metrics_replace(M_KAFKA_BROKER_RTT_P99, n, labels, rtt) != 0 ||
            metrics_replace(M_KAFKA_BROKER_INFLIGHT, n, labels, inflight) != 0 ||
            metrics_replace(M_KAFKA_BROKER_OUTBUF, n, labels, outbuf) != 0)
                rc = -1;
        metrics_set(M_KAFKA_BROKERS_UP, NULL, (double)s->brokers_up);
        metrics_set(M_KAFKA_QUEUE_MESSAGES, NULL, (double)s->queue_messages);
        if (s->retries > seen->retries)
                metrics_add(M_KAFKA_RETRIES, NULL, (double)(s->retries - seen->retries));
        if (s->errors > seen->errors)
                metrics_add(M_KAFKA_ERRORS, NULL, (double)(s->errors - seen->errors));
        seen->retries = s->retries;
        seen->errors = s->errors;
        return rc;
}
