/* health.c - readiness conditions, judged when asked. */
#include "health.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "encode.h"
#include "metrics.h"

#define REASON_MAX 240

struct condition {
        const char *name;
        int ok;
        char reason[REASON_MAX];
};

struct health {
        pthread_mutex_t lock;
        struct condition *conds;
        size_t n;
        double stall_s; /* 0: no lock/mark clocks (the sweeper) */
        double started, last_lock, last_mark, waiting_since;
        int holding_full, stopping;
};

struct health *health_new(const char *const *names, size_t n, double stall_s) {
        struct health *h = calloc(1, sizeof *h);
        if (!h)
                return NULL;
        h->conds = calloc(n, sizeof *h->conds);
        if (!h->conds) {
                free(h);
                return NULL;
        }
        pthread_mutex_init(&h->lock, NULL);
        h->n = n;
        h->stall_s = stall_s;
        h->started = clock_mono_s();
        for (size_t i = 0; i < n; i++) {
                h->conds[i].name = names[i];
                snprintf(h->conds[i].reason, REASON_MAX, "starting");
        }
        return h;
}

void health_destroy(struct health *h) {
        if (!h)
                return;
        pthread_mutex_destroy(&h->lock);
        free(h->conds);
        free(h);
}

void health_set(struct health *h, size_t i, int ok, const char *fmt, ...) {
        va_list ap;
        if (i >= h->n)
                return;
        pthread_mutex_lock(&h->lock);
        h->conds[i].ok = ok;
        va_start(ap, fmt);
        vsnprintf(h->conds[i].reason, REASON_MAX, fmt, ap);
        va_end(ap);
        encode_utf8_clean(h->conds[i].reason);
        pthread_mutex_unlock(&h->lock);
}

int health_ok(struct health *h, size_t i) {
        pthread_mutex_lock(&h->lock);
        int ok = i < h->n && h->conds[i].ok;
        pthread_mutex_unlock(&h->lock);
        return ok;
}

void health_lock_done(struct health *h, double now) {
        pthread_mutex_lock(&h->lock);
        h->last_lock = now;
        pthread_mutex_unlock(&h->lock);
}

void health_mark_done(struct health *h, double now) {
        pthread_mutex_lock(&h->lock);
        h->last_mark = now;
        pthread_mutex_unlock(&h->lock);
}

void health_mark_waiting(struct health *h, double since) {
        pthread_mutex_lock(&h->lock);
        h->waiting_since = since;
        pthread_mutex_unlock(&h->lock);
}

void health_holding_full(struct health *h, int full) {
        pthread_mutex_lock(&h->lock);
        h->holding_full = full;
        pthread_mutex_unlock(&h->lock);
}

void health_stopping(struct health *h) {
        pthread_mutex_lock(&h->lock);
        h->stopping = 1;
        pthread_mutex_unlock(&h->lock);
}

/* The clock conditions, judged at `now`. Call with the lock held. */
struct clocks {
        int lock_ok, mark_ok, stall_ok;
        char lock[REASON_MAX], mark[REASON_MAX], stall[REASON_MAX];
        double lock_age, mark_age;
};

static void judge(const struct health *h, double now, struct clocks *c) {
        /* before the first lock, the start counts as one: a relay gets one
         * bound to make its connections */
        double lock = h->last_lock > 0 ? h->last_lock : h->started;
        double mark = h->last_mark > 0 ? h->last_mark : h->started;
        double last = lock > mark ? lock : mark;
        c->lock_age = now - lock;
        c->mark_age = h->waiting_since > 0 ? now - h->waiting_since : 0;
        c->lock_ok = c->lock_age <= h->stall_s || h->holding_full;
        if (h->holding_full)
                snprintf(c->lock, REASON_MAX, "not locking: holding as many rows as it may");
        else
                snprintf(c->lock, REASON_MAX, "last lock %.1f s ago (bound %.1f s)", c->lock_age,
                         h->stall_s);
        c->mark_ok = c->mark_age <= h->stall_s;
        if (h->waiting_since > 0)
                snprintf(c->mark, REASON_MAX,
                         "oldest outcome waiting %.1f s for its mark (bound %.1f s)", c->mark_age,
                         h->stall_s);
        else
                snprintf(c->mark, REASON_MAX, "no outcome waits for its mark");
        c->stall_ok = now - last <= h->stall_s;
        snprintf(c->stall, REASON_MAX, "%s: last lock or mark %.1f s ago (bound %.1f s)",
                 c->stall_ok ? "turning" : "stalled", now - last, h->stall_s);
}

static int append_condition(struct buf *b, int *first, const char *name, int ok, const char *reason,
                            const char *extra) {
        if ((!*first && buf_append(b, ",", 1)) || buf_append_json_string(b, name) ||
            buf_appendf(b, ":{\"ok\":%s,\"reason\":", ok ? "true" : "false") ||
            buf_append_json_string(b, reason) || (extra && buf_appendf(b, "%s", extra)) ||
            buf_append(b, "}", 1))
                return -1;
        *first = 0;
        return 0;
}

int health_readyz(void *arg, struct buf *body) {
        struct health *h = arg;
        struct clocks c;
        int ready = 1, first = 1, rc = -1;
        char age[64];
        pthread_mutex_lock(&h->lock);
        for (size_t i = 0; i < h->n; i++)
                ready &= h->conds[i].ok;
        if (h->stall_s > 0) {
                judge(h, clock_mono_s(), &c);
                ready &= c.lock_ok && c.mark_ok && c.stall_ok;
        }
        ready &= !h->stopping;
        if (buf_appendf(body, "{\"ready\":%s,\"conditions\":{", ready ? "true" : "false"))
                goto out;
        for (size_t i = 0; i < h->n; i++)
                if (append_condition(body, &first, h->conds[i].name, h->conds[i].ok,
                                     h->conds[i].reason, NULL))
                        goto out;
        if (h->stall_s > 0) {
                snprintf(age, sizeof age, ",\"age_s\":%.1f", c.lock_age);
                if (append_condition(body, &first, "lock", c.lock_ok, c.lock, age))
                        goto out;
                snprintf(age, sizeof age, ",\"age_s\":%.1f", c.mark_age);
                if (append_condition(body, &first, "mark", c.mark_ok, c.mark, age) ||
                    append_condition(body, &first, "stall", c.stall_ok, c.stall, NULL))
                        goto out;
        }
        if (h->stopping && append_condition(body, &first, "stopping", 0, "stopping", NULL))
                goto out;
        if (buf_append(body, "}}\n", 3))
                goto out;
        rc = ready;
out:
        pthread_mutex_unlock(&h->lock);
        return rc;
}

void health_refresh_metrics(void *arg) {
        struct health *h = arg;
        struct buf scratch = {0};
        int ready = health_readyz(h, &scratch);
        buf_free(&scratch);
        metrics_set(M_READY, NULL, ready > 0);
        pthread_mutex_lock(&h->lock);
        for (size_t i = 0; i < h->n; i++)
                if (!strcmp(h->conds[i].name, "database"))
                        metrics_set(M_DATABASE_UP, NULL, h->conds[i].ok);
        if (h->stall_s > 0) {
                struct clocks c;
                judge(h, clock_mono_s(), &c);
                metrics_set(M_RELAY_STALLED, NULL, !c.stall_ok);
        }
        pthread_mutex_unlock(&h->lock);
}
