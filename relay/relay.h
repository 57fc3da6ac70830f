/* relay.h - the relay: one loop that owns time (docs/DESIGN.md, "The relay's
 * loop"). It locks batches of due rows on one database connection, fetches
 * their content, produces them (an aggregate's versions one after the other,
 * each once the one before it was acknowledged), marks each row as Kafka
 * answers on a second connection, and samples the table on a third. Several
 * batches are in flight at once, so a slow partition holds only its own rows
 * and their aggregates. */
#ifndef OUTBOX_RELAY_H
#define OUTBOX_RELAY_H

#include <signal.h>
#include <stddef.h>

#include "config.h"
#include "http.h"

struct relay;

/* Builds the relay (nothing connects yet); cfg and http (may be NULL) are
 * borrowed and must outlive it. NULL on failure (errstr says why). */
struct relay *relay_new(const struct config *cfg, struct http *http, char *errstr,
                        size_t errstr_size);

/* Runs the loop until *stop is set and the work in hand is done (or given
 * back), or a fatal error. `wake` is a descriptor that turns readable when a
 * signal arrived (-1: none). Returns the exit code: 0 clean stop, 1 when
 * rows were left PUBLISHING for the sweeper or on a fatal error, 2 when the
 * server is older than the oldest supported. */
int relay_run(struct relay *r, volatile sig_atomic_t *stop, int wake);

/* Frees everything. NULL is a no-op. */
void relay_destroy(struct relay *r);

#endif
