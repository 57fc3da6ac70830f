/* health.h - what /readyz answers and the gauges that say the same: a list
 * of named conditions, each ok or not with a short reason, and for the
 * relay the time since its last completed lock and mark, judged when a
 * probe or a scrape asks, so a loop that stopped turning is seen too
 * (docs/DESIGN.md, "Observability"). The main loop writes, the HTTP thread
 * reads; every call is thread-safe. */
#ifndef OUTBOX_HEALTH_H
#define OUTBOX_HEALTH_H

#include <stddef.h>

struct buf;
struct health;

/* The conditions, in the order /readyz lists them: `names` (static
 * strings), all not ok ("starting") until set. With `stall_s` > 0 (the
 * relay) three more are judged from the clock: lock, mark and stall. NULL
 * out of memory. */
struct health *health_new(const char *const *names, size_t n, double stall_s);

/* Frees. NULL is a no-op. */
void health_destroy(struct health *h);

/* Sets condition `i` (an index into `names`) and its reason. Logs nothing:
 * the caller logs state changes. */
void health_set(struct health *h, size_t i, int ok, const char *fmt, ...)
        __attribute__((format(printf, 4, 5)));

/* Nonzero when condition i is ok now. */
int health_ok(struct health *h, size_t i);

/* The relay's clocks (monotonic seconds): a lock statement completed; a
 * mark statement completed; since when an outcome waits for its mark (0:
 * none waits); whether the relay holds as many rows as it may (a lock is
 * then not due, and its age says nothing). */
void health_lock_done(struct health *h, double now);
void health_mark_done(struct health *h, double now);
void health_mark_waiting(struct health *h, double since);
void health_holding_full(struct health *h, int full);

/* The process is stopping: not ready, whatever else holds. */
void health_stopping(struct health *h);

/* The answer to /readyz (an http_ready_fn): 1 ready, 0 not, -1 out of
 * memory; body gets {"ready":..,"conditions":{name:{"ok":..,"reason":..},..}}. */
int health_readyz(void *h, struct buf *body);

/* Sets outbox_ready, outbox_database_up (from condition `database` when
 * there is one) and outbox_relay_stalled from the state now (a
 * metrics_set_render_hook hook). */
void health_refresh_metrics(void *h);

#endif
