/* ctl_reconcile.c - outboxctl reconcile: is every PUBLISHED row of a window
 * on Kafka, in order? (docs/DESIGN.md, "Reconciling with Kafka".)
 *
 * Memory stays bounded whatever the window: the client holds one message at
 * a time (plus librdkafka's fetched-ahead queue of one partition, and a COPY
 * buffer), streaming (topic, partition, offset, timestamp, event id, the
 * aggregate headers) into a temp table with COPY; PostgreSQL does the set
 * and window operations, spilling to disk as its work_mem says. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "ctl.h"
#include "ctl_print.h"
#include "encode.h"
#include "kafka_read.h"
#include "log.h"

#define PROGRESS_EVERY_S 5.0
/* librdkafka's fetched-ahead messages, one partition at a time. */
#define QUEUED_KBYTES    16384
#define KAFKA_TIMEOUT_MS 10000
#define KAFKA_IDLE_MS    30000

struct examples {
        struct db_rows *missing, *reorders, *duplicates, *unknown;
};

static void examples_free(struct examples *e) {
        db_rows_free(e->missing);
        db_rows_free(e->reorders);
        db_rows_free(e->duplicates);
        db_rows_free(e->unknown);
}

/* Streams the planned messages into the database. */
static int copy_messages(struct ctl *c, struct kafka_reader *r, char *err, size_t size) {
        struct kafka_read_msg m;
        double start = clock_mono_s(), next_progress = start + PROGRESS_EVERY_S;
        if (db_reconcile_begin(c->db, err, size) != 0)
                return -1;
        while (kafka_reader_next(r, &m, KAFKA_IDLE_MS) == 1) {
                char id[37];
                int is_id = m.event_id && ctl_is_uuid(m.event_id, m.event_id_len);
                if (is_id) {
                        memcpy(id, m.event_id, 36);
                        id[36] = '\0';
                }
                struct db_reconcile_msg dm = {m.topic,
                                              m.partition,
                                              m.offset,
                                              m.timestamp_ms,
                                              is_id ? id : NULL,
                                              m.tenant_id,
                                              m.aggregate_type,
                                              m.aggregate_id,
                                              m.aggregate_version,
                                              m.tenant_id_len,
                                              m.aggregate_type_len,
                                              m.aggregate_id_len,
                                              m.aggregate_version_len};
                if (db_reconcile_put(c->db, &dm, err, size) != 0)
                        return -1;
                if (clock_mono_s() >= next_progress) {
                        int parts;
                        long long planned, read;
                        next_progress += PROGRESS_EVERY_S;
                        kafka_reader_progress(r, &parts, &planned, &read);
                        log_info("reconcile", "reading Kafka",
                                 "messages=%lld of_about=%lld partitions=%d elapsed_s=%.0f", read,
                                 planned, parts, clock_mono_s() - start);
                }
        }
        return db_reconcile_end(c->db, err, size);
}

/* The topics read: names, their rows in the window, found on Kafka; the
 * partitions that were scanned (no offsets by time) or not read at all. */
struct topics {
        const char **names;
        long long *rows;
        size_t n;
        const struct kafka_reader *r;
        size_t scanned, unread;
};

/* Counts the scanned and unread partitions of the plan into t. */
static void count_partitions(struct topics *t) {
        struct kafka_read_part p;
        for (size_t i = 0; i < kafka_reader_partitions(t->r); i++) {
                kafka_reader_partition(t->r, i, &p);
                t->scanned += p.scanned && !p.unread;
                t->unread += p.unread != NULL;
        }
}

/* The partitions that were scanned (unread 0) or not read (unread 1), as a
 * JSON array of {"topic", "partition"[, "reason"]}. */
static int json_partitions(struct buf *b, const struct topics *t, int unread) {
        struct kafka_read_part p;
        int rc = buf_append(b, "[", 1), first = 1;
        for (size_t i = 0; rc == 0 && i < kafka_reader_partitions(t->r); i++) {
                kafka_reader_partition(t->r, i, &p);
                if (unread ? !p.unread : !p.scanned || p.unread)
                        continue;
                rc = buf_appendf(b, "%s{\"topic\": ", first ? "" : ", ");
                rc = rc ? rc : buf_append_json_string(b, p.topic);
                rc = rc ? rc : buf_appendf(b, ", \"partition\": %d", p.partition);
                if (unread) {
                        rc = rc ? rc : buf_appendf(b, ", \"reason\": ");
                        rc = rc ? rc : buf_append_json_string(b, p.unread);
                }
                rc = rc ? rc : buf_append(b, "}", 1);
                first = 0;
        }
        return rc ? rc : buf_append(b, "]", 1);
}

/* The one JSON object of --json. */
static int print_json(const struct ctl_args *a, const char *since, const char *until,
                      const struct topics *t, const struct db_reconcile_counts *n,
                      long long released, const struct examples *e) {
        struct buf b = {0};
        int ok = n->missing == 0 && n->reorders == 0 && t->unread == 0;
        int rc = buf_appendf(&b,
                             "{\"since\": \"%s\", \"until\": \"%s\", \"margin_s\": %lld, "
                             "\"topics\": [",
                             since, until, a->margin_ms / 1000);
        for (size_t i = 0; rc == 0 && i < t->n; i++) {
                rc = buf_appendf(&b, "%s{\"topic\": ", i ? ", " : "");
                rc = rc ? rc : buf_append_json_string(&b, t->names[i]);
                rc = rc ? rc
                        : buf_appendf(&b, ", \"rows\": %lld, \"on_kafka\": %s}", t->rows[i],
                                      kafka_reader_topic_found(t->r, i) ? "true" : "false");
        }
        char missing[32];
        /* rows not found while a partition could not be read may be there */
        snprintf(missing, sizeof missing, t->unread ? "null" : "%lld", n->missing);
        rc = rc ? rc
                : buf_appendf(&b,
                              "], \"rows\": %lld, \"messages\": %lld, \"missing\": %s, "
                              "\"not_found\": %lld, \"cannot_tell\": %s, "
                              "\"reorders\": %lld, \"duplicates\": %lld, "
                              "\"duplicate_copies\": %lld, \"unknown\": %lld, "
                              "\"gap_released\": %lld, \"scanned_partitions\": ",
                              n->rows, n->messages, missing, n->missing,
                              t->unread ? "true" : "false", n->reorders, n->duplicates, n->copies,
                              n->unknown, released);
        rc = rc ? rc : json_partitions(&b, t, 0);
        rc = rc ? rc : buf_appendf(&b, ", \"unread_partitions\": ");
        rc = rc ? rc : json_partitions(&b, t, 1);
        rc = rc ? rc : buf_appendf(&b, ", \"missing_ids\": ");
        rc = rc ? rc : ctl_json_column(&b, e->missing, 0);
        rc = rc ? rc
                : buf_appendf(&b, ", \"missing_ids_truncated\": %s, \"missing_examples\": ",
                              e->missing->nrows < n->missing ? "true" : "false");
        rc = rc ? rc : ctl_json_rows(&b, e->missing);
        rc = rc ? rc : buf_appendf(&b, ", \"reorder_examples\": ");
        rc = rc ? rc : ctl_json_rows(&b, e->reorders);
        rc = rc ? rc : buf_appendf(&b, ", \"duplicate_examples\": ");
        rc = rc ? rc : ctl_json_rows(&b, e->duplicates);
        rc = rc ? rc : buf_appendf(&b, ", \"unknown_examples\": ");
        rc = rc ? rc : ctl_json_rows(&b, e->unknown);
        rc = rc ? rc : buf_appendf(&b, ", \"ok\": %s}\n", ok ? "true" : "false");
        if (rc == 0)
                fwrite(b.data, 1, b.len, stdout);
        buf_free(&b);
        return rc;
}

static void print_text(const struct ctl_args *a, const char *since, const char *until,
                       const struct topics *t, const struct db_reconcile_counts *n,
                       long long released, const struct examples *e) {
        char from[40], to[40];
        int parts = 0;
        long long planned = 0, read = 0;
        ctl_format_time(a->since_ms - a->margin_ms, from, sizeof from);
        ctl_format_time(a->until_ms + a->margin_ms, to, sizeof to);
        kafka_reader_progress(t->r, &parts, &planned, &read);
        printf("rows published from %s to %s;\nmessages with timestamps from %s to %s "
               "(margin %llds)\n",
               since, until, from, to, a->margin_ms / 1000);
        for (size_t i = 0; i < t->n; i++)
                printf("topic %s: %lld row(s)%s\n", t->names[i], t->rows[i],
                       kafka_reader_topic_found(t->r, i) ? "" : " (not on Kafka)");
        printf("\nrows        %10lld  PUBLISHED rows in the window", n->rows);
        if (released)
                printf(" (%lld GAP_RELEASED record(s) left out)", released);
        printf("\nmessages    %10lld  messages read (%d partition(s))\n", n->messages, parts);
        if (t->scanned)
                printf("scanned     %10zu  partition(s) read from their start and filtered by "
                       "timestamp (the broker cannot look offsets up by time)\n",
                       t->scanned);
        if (t->unread)
                printf("missing              ?  cannot tell: %lld row(s) not found, and %zu "
                       "partition(s) could not be read\n",
                       n->missing, t->unread);
        else
                printf("missing     %10lld  rows with no message on Kafka\n", n->missing);
        printf("reorders    %10lld  first copies after a higher version's first copy (same "
               "aggregate, same partition)\n",
               n->reorders);
        printf("duplicates  %10lld  event ids on Kafka more than once (%lld extra copies; "
               "allowed)\n",
               n->duplicates, n->copies);
        printf("unknown     %10lld  messages whose event id is not in the table (e.g. "
               "deleted by retention)\n",
               n->unknown);
        const struct {
                const char *title;
                const struct db_rows *rows;
        } lists[] = {
                {t->unread ? "not found, maybe in the partitions not read" : "missing", e->missing},
                {"reorders", e->reorders},
                {"duplicates", e->duplicates},
                {"unknown", e->unknown}};
        for (size_t i = 0; i < sizeof lists / sizeof lists[0]; i++) {
                if (!lists[i].rows || lists[i].rows->nrows == 0)
                        continue;
                printf("\n%s (first %d):\n", lists[i].title, lists[i].rows->nrows);
                ctl_print_table(stdout, lists[i].rows);
        }
        if (t->unread) {
                struct kafka_read_part p;
                printf("\nnot read:\n");
                for (size_t i = 0; i < kafka_reader_partitions(t->r); i++) {
                        kafka_reader_partition(t->r, i, &p);
                        if (p.unread)
                                printf("  %s[%d]: %s\n", p.topic, p.partition, p.unread);
                }
        }
        if (n->reorders)
                printf("\nresult: PROBLEM: %lld reorder(s)%s\n", n->reorders,
                       t->unread ? "; missing: cannot tell (partitions not read)" : "");
        else if (t->unread)
                printf("\nresult: CANNOT TELL: %zu partition(s) could not be read; the %lld "
                       "row(s) not found may be there\n",
                       t->unread, n->missing);
        else if (n->missing)
                printf("\nresult: PROBLEM: %lld missing\n", n->missing);
        else
                printf("\nresult: ok\n");
}

int ctl_reconcile(struct ctl *c) {
        const struct ctl_args *a = c->args;
        char since[40], until[40], err[512];
        struct db_rows *in_window = NULL;
        struct kafka_reader *r = NULL;
        struct examples e = {0};
        struct db_reconcile_counts n;
        struct topics t = {0};
        long long released = 0, rows = 0;
        int rc = 1;

        ctl_format_time(a->since_ms, since, sizeof since);
        ctl_format_time(a->until_ms, until, sizeof until);
        if (db_reconcile_rows(c->db, since, until, a->topics, a->ntopics, &rows, &released,
                              &in_window, err, sizeof err) != 0)
                goto fail;
        /* the topics named, or those of the window's rows */
        size_t cap = a->ntopics ? a->ntopics : (size_t)in_window->nrows;
        t.names = calloc(cap + 1, sizeof *t.names);
        t.rows = calloc(cap + 1, sizeof *t.rows);
        if (!t.names || !t.rows) {
                snprintf(err, sizeof err, "out of memory");
                goto fail;
        }
        for (size_t i = 0; i < cap; i++) {
                t.names[i] = a->ntopics ? a->topics[i] : in_window->cells[i * 2];
                for (int k = 0; k < in_window->nrows; k++)
                        if (!strcmp(in_window->cells[(size_t)k * 2], t.names[i]))
                                t.rows[i] = strtoll(in_window->cells[(size_t)k * 2 + 1], NULL, 10);
        }
        t.n = cap;
        if (!(r = kafka_reader_new(c->cfg, QUEUED_KBYTES, err, sizeof err)))
                goto fail;
        t.r = r;
        if (kafka_reader_plan(r, t.names, t.n, a->since_ms - a->margin_ms,
                              a->until_ms + a->margin_ms, KAFKA_TIMEOUT_MS, err, sizeof err) != 0)
                goto fail;
        log_debug("reconcile", "reading Kafka", "topics=%zu rows=%lld", t.n, rows);
        if (copy_messages(c, r, err, sizeof err) != 0)
                goto fail;
        count_partitions(&t);
        if (db_reconcile_counts(c->db, &n, err, sizeof err) != 0 ||
            db_reconcile_examples(c->db, DB_RC_MISSING, a->examples, &e.missing, err, sizeof err) !=
                    0 ||
            db_reconcile_examples(c->db, DB_RC_REORDERS, a->examples, &e.reorders, err,
                                  sizeof err) != 0 ||
            db_reconcile_examples(c->db, DB_RC_DUPLICATES, a->examples, &e.duplicates, err,
                                  sizeof err) != 0 ||
            db_reconcile_examples(c->db, DB_RC_UNKNOWN, a->examples, &e.unknown, err, sizeof err) !=
                    0)
                goto fail;
        if (a->json) {
                if (print_json(a, since, until, &t, &n, released, &e) != 0) {
                        snprintf(err, sizeof err, "out of memory");
                        goto fail;
                }
        } else {
                print_text(a, since, until, &t, &n, released, &e);
        }
        /* a reorder found is a problem whatever was not read; rows not
         * found are one only when every partition was read */
        rc = n.reorders ? 1 : t.unread ? CTL_EXIT_CANNOT_TELL : n.missing ? 1 : 0;
        if (t.unread)
                log_warn("reconcile", "cannot tell: partitions could not be read",
                         "partitions=%zu not_found=%lld", t.unread, n.missing);
        goto out;
fail:
        log_error("reconcile", "reconcile failed", "err=%s", err);
out:
        free(t.names);
        free(t.rows);
        kafka_reader_destroy(r);
        examples_free(&e);
        db_rows_free(in_window);
        return rc;
}
