/* ctl_commands.c - the table commands: stats, dead, requeue, gaps,
 * release-gap. Tables as psql prints them, or one JSON object (--json). */
#include <stdio.h>
#include <stdlib.h>

#include "ctl.h"
#include "ctl_print.h"
#include "log.h"

/* Logs a failed statement; the exit code of a runtime error. */
static int failed(const char *what, const char *err) {
        log_error("outboxctl", "command failed", "command=%s err=%s", what, err);
        return 1;
}

/* Writes the JSON object in b (a line) to stdout; 1 when b could not be
 * built (out of memory). */
static int emit(struct buf *b, int built, const char *what) {
        int rc = 0;
        if (built != 0 || buf_append(b, "}\n", 2) != 0)
                rc = failed(what, "out of memory");
        else
                fwrite(b->data, 1, b->len, stdout);
        buf_free(b);
        return rc;
}

int ctl_stats(struct ctl *c) {
        struct db_rows *counts = NULL, *oldest = NULL;
        char err[512];
        int rc = 0;
        if (db_admin_stats(c->db, &counts, &oldest, err, sizeof err) != 0) {
                rc = failed("stats", err);
        } else if (c->args->json) {
                struct buf b = {0};
                int built = buf_appendf(&b, "{\"counts\": {");
                for (int i = 0; built == 0 && i < counts->nrows; i++)
                        built = buf_appendf(&b, "%s\"%s\": %s", i ? ", " : "", counts->cells[i * 2],
                                            counts->cells[i * 2 + 1]);
                const char *age = oldest->nrows ? oldest->cells[0] : NULL;
                const char *at = oldest->nrows ? oldest->cells[1] : NULL;
                built = built ? built
                              : buf_appendf(&b,
                                            "}, \"oldest_due_age_s\": %s, "
                                            "\"oldest_due_created_at\": ",
                                            age ? age : "null");
                built = built ? built : buf_append_json_string(&b, at);
                rc = emit(&b, built, "stats");
        } else {
                ctl_print_table(stdout, counts);
                ctl_print_table(stdout, oldest);
        }
        db_rows_free(counts);
        db_rows_free(oldest);
        return rc;
}

/* A listing with a --limit: dead, gaps. One row more than the limit is
 * read to tell whether there are more. */
typedef int(listing_fn)(struct db *db, long long limit, int json, struct db_rows **out,
                        char *errstr, size_t errstr_size);

static int listing(struct ctl *c, const char *what, const char *key, listing_fn *fn) {
        const struct ctl_args *a = c->args;
        struct db_rows *r = NULL;
        char err[512];
        if (fn(c->db, a->limit + 1, a->json, &r, err, sizeof err) != 0)
                return failed(what, err);
        int more = r->nrows > a->limit;
        db_rows_truncate(r, (int)a->limit);
        int rc = 0;
        if (a->json) {
                struct buf b = {0};
                int built = buf_appendf(&b, "{\"%s\": ", key);
                built = built ? built : ctl_json_rows(&b, r);
                built = built ? built
                              : buf_appendf(&b, ", \"limit\": %lld, \"truncated\": %s", a->limit,
                                            more ? "true" : "false");
                rc = emit(&b, built, what);
        } else {
                ctl_print_table(stdout, r);
                if (more)
                        printf("(more than %lld: --limit N shows more)\n", a->limit);
        }
        db_rows_free(r);
        return rc;
}

int ctl_dead(struct ctl *c) {
        return listing(c, "dead", "dead", db_admin_dead);
}

int ctl_gaps(struct ctl *c) {
        return listing(c, "gaps", "gaps", db_admin_gaps);
}

/* requeue --dry-run: what it would move and free. */
static int requeue_plan(struct ctl *c, const struct db_requeue *q) {
        const struct ctl_args *a = c->args;
        struct db_rows *rows = NULL, *freed_aggs = NULL;
        long long moved, freed;
        char err[512];
        int rc = 0;
        if (db_admin_requeue_plan(c->db, q, a->limit + 1, &moved, &freed, &rows, &freed_aggs, err,
                                  sizeof err) != 0) {
                rc = failed("requeue", err);
                goto out;
        }
        /* one more than the limit was read, to tell whether there are more */
        int more_rows = rows->nrows > a->limit, more_aggs = freed_aggs->nrows > a->limit;
        db_rows_truncate(rows, (int)a->limit);
        db_rows_truncate(freed_aggs, (int)a->limit);
        if (a->json) {
                struct buf b = {0};
                int built = buf_appendf(&b,
                                        "{\"dry_run\": true, \"requeued\": %lld, \"freed\": %lld, "
                                        "\"rows\": ",
                                        moved, freed);
                built = built ? built : ctl_json_rows(&b, rows);
                built = built ? built
                              : buf_appendf(&b, ", \"rows_truncated\": %s, \"freed_aggregates\": ",
                                            more_rows ? "true" : "false");
                built = built ? built : ctl_json_rows(&b, freed_aggs);
                built = built ? built
                              : buf_appendf(&b, ", \"freed_aggregates_truncated\": %s",
                                            more_aggs ? "true" : "false");
                rc = emit(&b, built, "requeue");
        } else {
                printf("would requeue %lld row(s)", moved);
                if (freed > 0)
                        printf(", %lld parked version(s) due again", freed);
                printf(" (dry run: nothing changed)\n");
                if (rows->nrows > 0) {
                        printf("\nrows it would requeue%s:\n",
                               more_rows ? " (the first, --limit)" : "");
                        ctl_print_table(stdout, rows);
                }
                if (freed_aggs->nrows > 0) {
                        printf("parked versions it would make due, by aggregate%s:\n",
                               more_aggs ? " (the first, --limit)" : "");
                        ctl_print_table(stdout, freed_aggs);
                }
        }
out:
        db_rows_free(rows);
        db_rows_free(freed_aggs);
        return rc;
}

int ctl_requeue(struct ctl *c) {
        const struct ctl_args *a = c->args;
        struct db_requeue q = {a->id,           a->tenant,   a->aggregate_type,
                               a->aggregate_id, a->all_dead, a->code};
        long long moved, freed;
        char err[512];
        if (a->dry_run)
                return requeue_plan(c, &q);
        if (db_admin_requeue(c->db, &q, &moved, &freed, err, sizeof err) != 0)
                return failed("requeue", err);
        if (a->json) {
                struct buf b = {0};
                int built =
                        buf_appendf(&b, "{\"dry_run\": false, \"requeued\": %lld, \"freed\": %lld",
                                    moved, freed);
                return emit(&b, built, "requeue");
        }
        printf("requeued %lld row(s)", moved);
        if (freed > 0)
                printf(", %lld parked version(s) due again", freed);
        printf("\n");
        return 0;
}

int ctl_release_gap(struct ctl *c) {
        const struct ctl_args *a = c->args;
        long long from = 0, to = 0;
        int released;
        char err[512];
        if (db_admin_release_gap(c->db, a->tenant, a->aggregate_type, a->aggregate_id, &released,
                                 &from, &to, err, sizeof err) != 0)
                return failed("release-gap", err);
        if (a->json) {
                struct buf b = {0};
                int built = buf_appendf(
                        &b, "{\"released\": %s, \"tenant_id\": ", released ? "true" : "false");
                built = built ? built : buf_append_json_string(&b, a->tenant);
                built = built ? built : buf_appendf(&b, ", \"aggregate_type\": ");
                built = built ? built : buf_append_json_string(&b, a->aggregate_type);
                built = built ? built : buf_appendf(&b, ", \"aggregate_id\": ");
                built = built ? built : buf_append_json_string(&b, a->aggregate_id);
                if (released)
                        built = built ? built
                                      : buf_appendf(&b,
                                                    ", \"missing_from\": %lld, "
                                                    "\"missing_to\": %lld",
                                                    from, to);
                if (emit(&b, built, "release-gap") != 0)
                        return 1;
        } else if (released) {
                if (from == to)
                        printf("released %lld: the versions after it are due\n", from);
                else
                        printf("released %lld-%lld: the versions after them are due\n", from, to);
        }
        if (!released) {
                log_error("outboxctl", "no version gap holds the aggregate",
                          "tenant_id=%s aggregate_type=%s aggregate_id=%s", a->tenant,
                          a->aggregate_type, a->aggregate_id);
                return 1;
        }
        return 0;
}
