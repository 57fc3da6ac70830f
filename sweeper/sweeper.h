/* sweeper.h - returns stale PUBLISHING locks and deletes PUBLISHED rows past
 * retention (docs/DESIGN.md, "The sweeper"). Several instances may run at once:
 * every statement takes its rows with FOR UPDATE SKIP LOCKED. */
#ifndef OUTBOX_SWEEPER_H
#define OUTBOX_SWEEPER_H

#include <signal.h>
#include <stddef.h>

#include "config.h"
#include "http.h"

struct sweeper;

/* What one sweep did. */
struct sweep_result {
        long long stale_reset; /* PUBLISHING rows returned to FAILED (STALE_LOCK) */
        long long deleted;     /* PUBLISHED rows deleted */
        long long parked;      /* versions parked behind a DEAD version */
        long long unparked;    /* parked versions made due again */
        int statements;        /* delete statements run */
};

/* Builds the sweeper from a loaded configuration; nothing connects yet.
 * `cfg` and `http` (may be NULL) are borrowed and must outlive the sweeper.
 * NULL on failure (errstr says why). */
struct sweeper *sweeper_new(const struct config *cfg, struct http *http, char *errstr,
                            size_t errstr_size);

/* One sweep on a connected database: resets stale locks; makes parked
 * versions due again where no DEAD version of their aggregate is below them,
 * and parks the versions behind DEAD ones (only under OUTBOX_ORDERING=
 * aggregate; under none it makes every parked version due), in statements
 * of 10 x OUTBOX_DELETE_BATCH rows, a failure there logged and passed over;
 * then (unless retention is 0) deletes PUBLISHED rows past retention in
 * statements of at most OUTBOX_DELETE_BATCH rows, each its own transaction,
 * until a statement deletes fewer than that. After *stop is set, no new step
 * starts. *res gets what was done, also on failure. 0, or -1 with errstr set
 * (the connection may have been dropped). */
int sweeper_sweep(struct sweeper *s, volatile sig_atomic_t *stop, struct sweep_result *res,
                  char *errstr, size_t errstr_size) __attribute__((warn_unused_result));

/* Loop mode: sweeps every OUTBOX_SWEEP_INTERVAL_S until *stop is set,
 * reconnecting with backoff through database outages; returns 0. With --once
 * (cfg->once): one complete sweep, retrying a lost database for at most
 * SWEEPER_ONCE_RETRY_S seconds; returns 0 after the sweep or a stop request,
 * 1 when the sweep could not be completed. */
int sweeper_run(struct sweeper *s, volatile sig_atomic_t *stop);

#define SWEEPER_ONCE_RETRY_S 60

/* Closes and frees. NULL is a no-op. */
void sweeper_destroy(struct sweeper *s);

#endif
