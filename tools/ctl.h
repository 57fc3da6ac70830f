/* ctl.h - outboxctl's commands. Each takes the loaded configuration, the
 * parsed arguments and a connected admin database handle (migrate: an
 * unconnected one), writes its result on stdout and its diagnostics as log
 * lines, and returns the exit code: 0 ok, 1 a problem found or a runtime
 * error, 2 bad configuration or a server too old, CTL_EXIT_CANNOT_TELL
 * (reconcile) when part of what was to be compared could not be read. */
#ifndef OUTBOX_CTL_H
#define OUTBOX_CTL_H

#include "config.h"
#include "ctl_args.h"
#include "db_admin.h"

/* reconcile: some partitions could not be read, and rows not found may be
 * there (2 is usage and configuration). */
#define CTL_EXIT_CANNOT_TELL 3

struct ctl {
        const struct config *cfg;
        const struct ctl_args *args;
        struct db *db;
};

int ctl_stats(struct ctl *c);
int ctl_dead(struct ctl *c);
int ctl_requeue(struct ctl *c);
int ctl_gaps(struct ctl *c);
int ctl_release_gap(struct ctl *c);
int ctl_replay(struct ctl *c);
int ctl_reconcile(struct ctl *c);
int ctl_migrate(struct ctl *c);

/* Milliseconds since the epoch, now. */
long long ctl_now_ms(void);

#endif
