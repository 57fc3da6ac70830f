/* relay.h - the relay loop: lock a batch, publish it, mark every row. */
#ifndef OUTBOX_RELAY_H
#define OUTBOX_RELAY_H

#include <signal.h>
#include <stddef.h>

#include "config.h"
#include "db.h"
#include "http.h"

struct relay;

/* Builds the relay (database handle, producer) from a loaded configuration;
 * nothing connects yet. `cfg` and `http` (may be NULL) are borrowed and must
 * outlive the relay. NULL on failure (errstr says why). */
struct relay *relay_new(const struct config *cfg, struct http *http, char *errstr,
                        size_t errstr_size);

/* Runs until *stop is set, then finishes the batch in flight (delivery reports
 * bounded by the delivery timeout), marks it and returns: 0 on a clean stop,
 * 1 on a fatal runtime error. Database and broker outages are retried, not
 * fatal. */
int relay_run(struct relay *r, volatile sig_atomic_t *stop);

/* Frees everything. NULL is a no-op. */
void relay_destroy(struct relay *r);

/* The lock statements' order rule for OUTBOX_ORDERING (enum config_ordering). */
enum db_order relay_db_order(int ordering);

/* Backoff before retry number `attempt` (1-based): initial * 2^(attempt-1)
 * capped at max_ms, then jittered into [delay/2, delay]. `seed` is the
 * caller's rand_r state. */
long long relay_backoff_ms(int attempt, int initial_ms, int max_ms, unsigned *seed);

#endif
