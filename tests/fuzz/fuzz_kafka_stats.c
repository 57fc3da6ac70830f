/* fuzz_kafka_stats.c - librdkafka's statistics JSON through
 * kafka_stats_parse() and kafka_stats_apply(): any input gives a result or an
 * error; a result lists at most KAFKA_STATS_MAX_BROKERS real brokers, in
 * node-id order without repeats, with counts and round trips that are
 * non-negative and finite; an error fills errstr with one NUL-terminated
 * line. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kafka_stats.h"

static struct kafka_stats_seen seen;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        if (size > 1024 * 1024)
                return 0;
        struct kafka_stats s;
        char err[128];
        memset(err, 'x', sizeof err);
        if (kafka_stats_parse((const char *)data, size, &s, err, sizeof err) != 0) {
                if (!memchr(err, '\0', sizeof err) || !err[0] || strchr(err, '\n'))
                        abort();
                return 0;
        }
        if (s.nbrokers > KAFKA_STATS_MAX_BROKERS || s.retries < 0 || s.errors < 0 ||
            s.queue_messages < 0 || s.brokers_up < 0)
                abort();
        long long up = 0;
        for (size_t i = 0; i < s.nbrokers; i++) {
                const struct kafka_stats_broker *b = &s.brokers[i];
                if (b->id < 0 || (i && b->id <= s.brokers[i - 1].id) || b->inflight < 0 ||
                    b->outbuf < 0 || !isfinite(b->rtt_p99_s) || b->rtt_p99_s < 0 ||
                    (b->up != 0 && b->up != 1))
                        abort();
                up += b->up;
        }
        if (up > s.brokers_up)
                abort();
        if (kafka_stats_apply(&s, &seen) != 0)
                abort();
        return 0;
}
