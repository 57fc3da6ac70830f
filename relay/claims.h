/* claims.h - the rows a relay holds in PUBLISHING: the batch being published,
 * the batch locked ahead while it is, and rows of lock statements whose
 * outcome the relay does not know (docs/DESIGN.md, "Locking ahead"). This is
 * the one owner of those rows: it locks, fills up, gives back and marks them,
 * and takes back what the relay id holds after a reconnect. Marks retry
 * through database outages; after a stop request, for at most 30 s. */
#ifndef OUTBOX_CLAIMS_H
#define OUTBOX_CLAIMS_H

#include <signal.h>
#include <stddef.h>

#include "config.h"
#include "db.h"
#include "http.h"

struct claims;

/* Builds the owner; `cfg`, `db` and `http` (may be NULL) are borrowed and
 * must outlive it. NULL on failure (errstr says why). */
struct claims *claims_new(const struct config *cfg, struct db *db, struct http *http, char *errstr,
                          size_t errstr_size);

/* Gives nothing back (the sweeper returns what is left) and frees. NULL is a
 * no-op. */
void claims_destroy(struct claims *c);

/* Connects if needed, and after a (re)connect or a lock statement with an
 * unknown outcome gives the batch locked ahead back and takes back whatever
 * else the relay id holds. 0 when the relay may lock; else -1 after waiting
 * (the reconnect backoff, or the poll interval). */
int claims_ready(struct claims *c, volatile sig_atomic_t *stop);

/* The batch to publish: the one locked ahead when it may still go (filled
 * up), else one locked now. Then sends the lock statement for the batch
 * after it, unless stopping. 0 with *batch (count 0 when nothing is due, or
 * when stopping), or -1 when locking failed (logged). */
int claims_lock(struct claims *c, volatile sig_atomic_t *stop, const struct db_batch **batch);

/* Nonzero while the lock ahead's result is owed; claims_poll_ahead() reads
 * what has arrived of it (a kafka_wait() tick: 0 once it is all there). */
int claims_ahead_pending(const struct claims *c);
int claims_poll_ahead(void *claims);

/* Collects the rows of the lock ahead, if one was sent. */
void claims_receive_ahead(struct claims *c);

/* The outcomes of the batch, filled by the caller for claims_settle():
 * one per row of *batch, in its order (OUTBOX_BATCH_SIZE of room). */
struct db_outcome *claims_outcomes(struct claims *c);

/* Marks the batch's first n outcomes and lets the batch go. 0, or -1 when
 * it could not be marked before stopping (the rows stay PUBLISHING). */
int claims_settle(struct claims *c, size_t n, volatile sig_atomic_t *stop);

/* At a stop: gives the batch locked ahead back and takes back the rows of
 * lock statements with an unknown outcome, while the database can be reached
 * within the stop grace. */
void claims_finish(struct claims *c, volatile sig_atomic_t *stop);

/* Nonzero when rows were left PUBLISHING for the sweeper: a batch that could
 * not be marked before stopping, or an unknown outcome not taken back. */
int claims_left_behind(const struct claims *c);

#endif
