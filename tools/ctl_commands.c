/* ctl_commands.c - the table commands: stats, dead, requeue, gaps,
 * release-gap. Output as the psql-based outboxctl printed it. */
#include <stdio.h>

#include "ctl.h"
#include "ctl_print.h"
#include "log.h"

/* Logs a failed statement; the exit code of a runtime error. */
static int failed(const char *what, const char *err) {
        log_error("outboxctl", "command failed", "command=%s err=%s", what, err);
        return 1;
}

int ctl_stats(struct ctl *c) {
        struct db_rows *counts = NULL, *oldest = NULL;
        char err[512];
        int rc = 0;
        if (db_admin_stats(c->db, &counts, &oldest, err, sizeof err) != 0) {
                rc = failed("stats", err);
        } else {
                ctl_print_table(stdout, counts);
                ctl_print_table(stdout, oldest);
        }
        db_rows_free(counts);
        db_rows_free(oldest);
        return rc;
}

/* A listing with a --limit: dead, gaps. */
typedef int(listing_fn)(struct db *db, long long limit, struct db_rows **out, char *errstr,
                        size_t errstr_size);

static int listing(struct ctl *c, const char *what, listing_fn *fn) {
        struct db_rows *r = NULL;
        char err[512];
        if (fn(c->db, c->args->limit, &r, err, sizeof err) != 0)
                return failed(what, err);
        ctl_print_table(stdout, r);
        db_rows_free(r);
        return 0;
}

int ctl_dead(struct ctl *c) {
        return listing(c, "dead", db_admin_dead);
}

int ctl_gaps(struct ctl *c) {
        return listing(c, "gaps", db_admin_gaps);
}

int ctl_requeue(struct ctl *c) {
        const struct ctl_args *a = c->args;
        struct db_requeue q = {a->id,           a->tenant,   a->aggregate_type,
                               a->aggregate_id, a->all_dead, a->code};
        long long moved, freed;
        char err[512];
        if (db_admin_requeue(c->db, &q, &moved, &freed, err, sizeof err) != 0)
                return failed("requeue", err);
        printf("requeued %lld row(s)", moved);
        if (freed > 0)
                printf(", %lld parked version(s) due again", freed);
        printf("\n");
        return 0;
}

int ctl_release_gap(struct ctl *c) {
        const struct ctl_args *a = c->args;
        long long from, to;
        int released;
        char err[512];
        if (db_admin_release_gap(c->db, a->tenant, a->aggregate_type, a->aggregate_id, &released,
                                 &from, &to, err, sizeof err) != 0)
                return failed("release-gap", err);
        if (!released) {
                log_error("outboxctl", "no version gap holds the aggregate",
                          "tenant_id=%s aggregate_type=%s aggregate_id=%s", a->tenant,
                          a->aggregate_type, a->aggregate_id);
                return 1;
        }
        printf("released %lld-%lld: the versions after them are due\n", from, to);
        return 0;
}
