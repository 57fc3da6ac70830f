/* decide.c - the relay's decisions as pure functions. */
#include "decide.h"

#include <string.h>

void decide_runs(enum config_ordering ordering, const struct decide_item *items, size_t n,
                 struct decide_run *out) {
        int released = 0; /* the current aggregate's run broke at a hole */
        for (size_t i = 0; i < n; i++) {
                const struct decide_item *it = &items[i];
                out[i].prev = -1;
                out[i].release = 0;
                if (!it->same_aggregate || i == 0) {
                        released = 0;
                        continue;
                }
                if (ordering == ORDERING_NONE || it->late || items[i - 1].late)
                        continue;
                long long before = items[i - 1].version;
                /* versions come in order: before <= version, so `before + 1`
                 * cannot overflow unless the two are equal */
                int hole = ordering == ORDERING_AGGREGATE && it->version != before &&
                           it->version != before + 1;
                if (hole)
                        released = 1;
                out[i].release = released;
                if (!released)
                        out[i].prev = (int)i - 1;
        }
}

enum decide_mark decide_failure(int permanent, int uncounted, int attempt_count, int max_attempts) {
        if (permanent || (!uncounted && attempt_count >= max_attempts))
                return DECIDE_DEAD;
        return DECIDE_FAILED;
}

long long decide_backoff_ms(int attempt, int initial_ms, int max_ms, unsigned random) {
        long long d = initial_ms > 0 ? initial_ms : 1;
        for (int i = 1; i < attempt && d < max_ms; i++)
                d *= 2;
        if (d > max_ms)
                d = max_ms;
        long long half = d / 2;
        return half + (long long)(random % (unsigned long long)(d - half + 1));
}

int decide_retry_ms(int failures, int cap_ms) {
        long long d = 100;
        for (int i = 1; i < failures && d < cap_ms; i++)
                d *= 2;
        return d > cap_ms ? cap_ms : (int)d;
}

int decide_row_unreadable(const char *sqlstate) {
        return sqlstate && strlen(sqlstate) == 5 &&
               (!strncmp(sqlstate, "22", 2) || !strncmp(sqlstate, "54", 2) ||
                !strcmp(sqlstate, "XX001") || !strcmp(sqlstate, "XX002"));
}
