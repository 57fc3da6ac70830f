/* batch.c - the rows of one lock statement, from the lock to the marks. */
#include "batch.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"

/* One fetch's answer and the rows that still need it. */
struct fetch_part {
        struct fetch_part *next;
        struct db_result *r;
        size_t refs;
        long long bytes;
};

/* The lock statements' columns (relay/sql/lock.sql, lock_none.sql). */
enum lock_col {
        L_CTID,
        L_ID,
        L_ATTEMPTS,
        L_LATE_AFTER,
        L_TENANT,
        L_AGG_TYPE,
        L_AGG_ID,
        L_VERSION,
        L_SIZE,
        L_KEY,
        L_DEFERRED,
        L_PARKED,
        L_NCOLS
};

/* The fetch's columns (relay/sql/fetch.sql). */
enum fetch_col {
        F_CTID,
        F_ID,
        F_SIZE,
        F_EVENT_TYPE,
        F_EVENT_VERSION,
        F_TOPIC,
        F_PKEY,
        F_EVENT_KEY,
        F_PAYLOAD,
        F_HEADERS,
        F_CORRELATION,
        F_CAUSATION,
        F_TRACE,
        F_OCCURRED,
        F_NCOLS
};

/* Compares two rows by aggregate, then version. */
static int by_aggregate(const void *pa, const void *pb) {
        const struct row *a = pa, *b = pb;
        int c = strcmp(a->ev.tenant_id, b->ev.tenant_id);
        if (!c)
                c = strcmp(a->ev.aggregate_type, b->ev.aggregate_type);
        if (!c)
                c = strcmp(a->ev.aggregate_id, b->ev.aggregate_id);
        if (!c)
                c = (a->ev.aggregate_version > b->ev.aggregate_version) -
                    (a->ev.aggregate_version < b->ev.aggregate_version);
        return c;
}

/* A row's ctid and its index, to match fetched rows. */
struct tid_index {
        unsigned char tid[6];
        size_t row;
};

static int by_tid(const void *pa, const void *pb) {
        return memcmp(((const struct tid_index *)pa)->tid, ((const struct tid_index *)pb)->tid, 6);
}

static int same_aggregate(const struct row *a, const struct row *b) {
        return !strcmp(a->ev.aggregate_id, b->ev.aggregate_id) &&
               !strcmp(a->ev.aggregate_type, b->ev.aggregate_type) &&
               !strcmp(a->ev.tenant_id, b->ev.tenant_id);
}

/* Cell (i, col) of r, NULL for SQL NULL. */
static const char *cell(const struct db_result *r, int i, int col) {
        return db_result_isnull(r, i, col) ? NULL : db_result_value(r, i, col);
}

static long long cell_int(const struct db_result *r, int i, int col) {
        return db_int(db_result_value(r, i, col), db_result_length(r, i, col));
}

/* Decides the runs of b's rows (they are in aggregate order) and settles
 * what cannot go: late rows DEAD, rows after a hole RELEASED. */
static int decide(struct batch *b, enum config_ordering ordering) {
        struct decide_item *items = calloc(b->n, sizeof *items);
        struct decide_run *runs = calloc(b->n, sizeof *runs);
        if (!items || !runs) {
                free(items);
                free(runs);
                return -1;
        }
        for (size_t i = 0; i < b->n; i++) {
                items[i].same_aggregate = i > 0 && same_aggregate(&b->rows[i], &b->rows[i - 1]);
                items[i].version = b->rows[i].ev.aggregate_version;
                items[i].late = b->rows[i].ev.late;
        }
        decide_runs(ordering, items, b->n, runs);
        for (size_t i = 0; i < b->n; i++) {
                struct row *w = &b->rows[i];
                w->prev = runs[i].prev;
                w->next = -1;
                if (w->prev >= 0)
                        b->rows[w->prev].next = (int)i;
                if (w->ev.late) {
                        char why[160];
                        snprintf(why, sizeof why,
                                 "version %lld committed after version %lld was published: not "
                                 "sent (per-aggregate order)",
                                 w->ev.aggregate_version, w->ev.late_after);
                        batch_settle(b, i, DECIDE_DEAD, "LATE_VERSION", why);
                } else if (runs[i].release) {
                        batch_settle(b, i, DECIDE_RELEASED, NULL, NULL);
                }
        }
        free(items);
        free(runs);
        return 0;
}

struct batch *batch_new(struct db_result *lock, enum config_ordering ordering, long lock_gen,
                        double locked_at) {
        struct batch *b = calloc(1, sizeof *b);
        size_t n = (size_t)db_result_rows(lock);
        if (!b || db_result_cols(lock) != L_NCOLS)
                goto fail;
        b->lock = lock;
        b->lock_gen = lock_gen;
        b->locked_at = locked_at;
        b->rows = calloc(n ? n : 1, sizeof *b->rows);
        b->by_tid = calloc(n ? n : 1, sizeof *b->by_tid);
        if (!b->rows || !b->by_tid)
                goto fail;
        size_t kept = 0;
        for (size_t j = 0; j < n; j++) {
                int k = (int)j;
                /* a row the statement moved back behind its aggregate's
                 * retry, or parked behind its DEAD version, is not this
                 * relay's */
                if (db_result_length(lock, k, L_DEFERRED) == 1 &&
                    db_result_value(lock, k, L_DEFERRED)[0]) {
                        if (db_result_length(lock, k, L_PARKED) == 1 &&
                            db_result_value(lock, k, L_PARKED)[0])
                                b->parked++;
                        continue;
                }
                struct row *w = &b->rows[kept++];
                const char *tid = db_result_value(lock, k, L_CTID);
                int tid_len = db_result_length(lock, k, L_CTID);
                if (tid_len == 6)
                        memcpy(w->tid_bin, tid, 6);
                db_tid_text(tid, tid_len, w->tid);
                db_uuid_text(db_result_value(lock, k, L_ID), db_result_length(lock, k, L_ID),
                             w->id);
                if (db_result_length(lock, k, L_ID) == 16)
                        memcpy(w->id_bin, db_result_value(lock, k, L_ID), 16);
                w->ev.outbox_id = w->id;
                w->ev.tid = w->tid;
                w->ev.attempt_count = (int)cell_int(lock, k, L_ATTEMPTS);
                w->ev.late = !db_result_isnull(lock, k, L_LATE_AFTER);
                w->ev.late_after = w->ev.late ? cell_int(lock, k, L_LATE_AFTER) : 0;
                w->ev.tenant_id = cell(lock, k, L_TENANT);
                w->ev.aggregate_type = cell(lock, k, L_AGG_TYPE);
                w->ev.aggregate_id = cell(lock, k, L_AGG_ID);
                w->ev.aggregate_version = cell_int(lock, k, L_VERSION);
                w->size = cell_int(lock, k, L_SIZE);
                w->key = cell_int(lock, k, L_KEY);
                w->stage = ROW_LOCKED;
                w->prev = w->next = -1;
        }
        n = kept;
        b->n = b->open = b->unfetched = n;
        qsort(b->rows, n, sizeof *b->rows, by_aggregate);
        for (size_t i = 0; i < n; i++) {
                /* the strings borrowed from the lock's answer stay where
                 * they are; these point into the row and moved with it */
                b->rows[i].batch = b;
                b->rows[i].ev.outbox_id = b->rows[i].id;
                b->rows[i].ev.tid = b->rows[i].tid;
        }
        for (size_t i = 0; i < n; i++) {
                memcpy(b->by_tid[i].tid, b->rows[i].tid_bin, 6);
                b->by_tid[i].row = i;
        }
        qsort(b->by_tid, n, sizeof *b->by_tid, by_tid);
        if (decide(b, ordering) != 0)
                goto fail;
        return b;
fail:
        if (b) {
                b->lock = NULL;
                batch_free(b);
        }
        db_result_free(lock);
        return NULL;
}

void batch_free(struct batch *b) {
        if (!b)
                return;
        for (size_t i = 0; i < b->n; i++)
                free(b->rows[i].topic);
        while (b->parts) {
                struct fetch_part *p = b->parts;
                b->parts = p->next;
                db_result_free(p->r);
                free(p);
        }
        db_result_free(b->lock);
        free(b->rows);
        free(b->by_tid);
        free(b);
}

/* Whether row i, still to fetch, is the first of its run still to fetch:
 * every version before it was fetched, so once read it can go (or wait
 * only for a version with the producer). */
static int run_head(const struct batch *b, size_t i) {
        for (int p = b->rows[i].prev; p >= 0; p = b->rows[p].prev)
                if (b->rows[p].stage == ROW_LOCKED)
                        return 0;
        return 1;
}

int batch_fetch_list(struct batch *b, enum fetch_ask ask, struct buf *tids, struct buf *ids) {
        buf_reset(tids);
        if (ids)
                buf_reset(ids);
        if (buf_append(tids, "{", 1) || (ids && buf_append(ids, "{", 1)))
                return -1;
        int first = 1;
        for (size_t i = 0; i < b->n; i++) {
                struct row *w = &b->rows[i];
                w->asked = w->stage == ROW_LOCKED && (ask == ASK_ALL || run_head(b, i)) &&
                           (ask != ASK_ONE || (first && w->suspect));
                if (!w->asked)
                        continue;
                if ((!first && buf_append(tids, ",", 1)) || buf_appendf(tids, "\"%s\"", w->tid) ||
                    (ids && ((!first && buf_append(ids, ",", 1)) || buf_appendf(ids, "%s", w->id))))
                        return -1;
                first = 0;
        }
        return buf_append(tids, "}", 1) || (ids && buf_append(ids, "}", 1));
}

int batch_suspects(const struct batch *b) {
        for (size_t i = 0; i < b->n; i++)
                if (b->rows[i].stage == ROW_LOCKED && b->rows[i].suspect)
                        return 1;
        return 0;
}

size_t batch_suspect_asked(struct batch *b) {
        size_t n = 0;
        for (size_t i = 0; i < b->n; i++)
                if (b->rows[i].stage == ROW_LOCKED && b->rows[i].asked) {
                        b->rows[i].suspect = 1;
                        n++;
                }
        return n;
}

/* The row of b with ctid `tid` (6 bytes), or -1. */
static long find_tid(const struct batch *b, const char *tid, int len) {
        if (len != 6)
                return -1;
        size_t lo = 0, hi = b->n;
        while (lo < hi) {
                size_t mid = (lo + hi) / 2;
                int c = memcmp(b->by_tid[mid].tid, tid, 6);
                if (c == 0)
                        return (long)b->by_tid[mid].row;
                if (c < 0)
                        lo = mid + 1;
                else
                        hi = mid;
        }
        return -1;
}

/* Fills row w from row k of a fetch's answer; 0, or -1 with the reason
 * (code, message) the row cannot become a message. */
static int fill(struct row *w, const struct db_result *r, int k, long long max_row,
                const char **code, char *why, size_t why_size) {
        struct outbox_event *e = &w->ev;
        w->size = cell_int(r, k, F_SIZE);
        e->event_type = cell(r, k, F_EVENT_TYPE);
        e->event_version = (int)cell_int(r, k, F_EVENT_VERSION);
        e->topic_name = cell(r, k, F_TOPIC);
        e->partition_key = cell(r, k, F_PKEY);
        e->event_key = cell(r, k, F_EVENT_KEY);
        e->payload = cell(r, k, F_PAYLOAD);
        e->payload_len = e->payload ? (size_t)db_result_length(r, k, F_PAYLOAD) : 0;
        e->headers = cell(r, k, F_HEADERS);
        e->correlation_id = cell(r, k, F_CORRELATION);
        e->causation_id = cell(r, k, F_CAUSATION);
        e->trace_id = cell(r, k, F_TRACE);
        long long us = db_timestamptz(db_result_value(r, k, F_OCCURRED),
                                      db_result_length(r, k, F_OCCURRED));
        e->occurred_at = w->occurred;
        e->occurred_at_epoch = 0;
        if (w->size > max_row) {
                *code = "MSG_SIZE_TOO_LARGE";
                snprintf(why, why_size,
                         "the row's text is %lld bytes, more than the producer's "
                         "message.max.bytes (%lld)",
                         w->size, max_row);
                return -1;
        }
        if (encode_rfc3339_us(us, w->occurred, sizeof w->occurred) != 0) {
                *code = "INVALID_VALUE";
                snprintf(why, why_size,
                         "occurred_at is outside what RFC 3339 can write (years 0001-9999): %s",
                         us == INT64_MAX   ? "infinity"
                         : us == INT64_MIN ? "-infinity"
                         : us < 0          ? "a date before year 1"
                                           : "a date after year 9999");
                return -1;
        }
        /* seconds since 1970 from microseconds since 2000 */
        e->occurred_at_epoch = (double)us / 1e6 + 946684800.0;
        return 0;
}

static void free_part(struct batch *b, struct fetch_part *p);
static void forget_content(struct row *w);

long batch_take_fetch(struct batch *b, struct db_result *r, long long max_row, long long *bytes,
                      long long *answered) {
        struct fetch_part *p = calloc(1, sizeof *p);
        long filled = 0;
        *bytes = 0;
        *answered = 0;
        if (!p || db_result_cols(r) != F_NCOLS) {
                free(p);
                db_result_free(r);
                return -1;
        }
        p->r = r;
        p->next = b->parts;
        b->parts = p;
        for (int k = 0; k < db_result_rows(r); k++) {
                long i = find_tid(b, db_result_value(r, k, F_CTID), db_result_length(r, k, F_CTID));
                /* Another row stands at the ctid: the row asked for moved.
                 * It counts as not found, so it is looked up by outbox_id
                 * (the answer's byte count leaves the stranger out). */
                if (i >= 0 && (db_result_length(r, k, F_ID) != 16 ||
                               memcmp(db_result_value(r, k, F_ID), b->rows[i].id_bin, 16) != 0))
                        continue;
                *answered += cell_int(r, k, F_SIZE);
                if (i < 0 || b->rows[i].stage != ROW_LOCKED)
                        continue;
                struct row *w = &b->rows[i];
                const char *code = NULL;
                char why[160];
                b->unfetched--;
                w->stage = ROW_READY;
                w->suspect = 0;
                filled++;
                b->dirty = 1;
                if (fill(w, r, k, max_row, &code, why, sizeof why) != 0) {
                        forget_content(w); /* the answer may go before the row's mark */
                        w->permanent = 1;
                        batch_settle(b, (size_t)i, DECIDE_DEAD, code, why);
                        continue;
                }
                w->part = p;
                p->refs++;
                p->bytes += w->size;
        }
        *bytes = p->bytes;
        if (p->refs == 0)
                free_part(b, p);
        return filled;
}

/* Unlinks and frees fetch part p. */
static void free_part(struct batch *b, struct fetch_part *p) {
        for (struct fetch_part **pp = &b->parts; *pp; pp = &(*pp)->next)
                if (*pp == p) {
                        *pp = p->next;
                        break;
                }
        db_result_free(p->r);
        free(p);
}

/* Row w's content pointers, which borrow from a fetch's answer, reset. */
static void forget_content(struct row *w) {
        w->ev.event_type = w->ev.topic_name = w->ev.partition_key = w->ev.event_key = NULL;
        w->ev.payload = w->ev.headers = NULL;
        w->ev.correlation_id = w->ev.causation_id = w->ev.trace_id = NULL;
        w->ev.payload_len = 0;
}

/* Frees fetch part p once no row needs it. */
static void drop_part(struct batch *b, struct fetch_part *p) {
        if (p && --p->refs == 0)
                free_part(b, p);
}

void batch_release_content(struct batch *b, size_t i) {
        struct row *w = &b->rows[i];
        struct fetch_part *p = w->part;
        if (!p)
                return;
        w->part = NULL;
        /* the content's strings go with the fetch: nothing reads them after */
        forget_content(w);
        drop_part(b, p);
}

void batch_settle(struct batch *b, size_t i, enum decide_mark mark, const char *code,
                  const char *msg) {
        struct row *w = &b->rows[i];
        if (w->stage == ROW_LOCKED)
                b->unfetched--;
        w->stage = ROW_SETTLED;
        w->suspect = 0;
        w->settled_at = clock_mono_s();
        w->mark = mark;
        w->code = code;
        snprintf(w->message, sizeof w->message, "%s", msg ? msg : "");
        encode_utf8_clean(w->message); /* cut mid-character, or foreign text */
        batch_release_content(b, i);
        b->dirty = 1;
}

long long batch_bytes(const struct batch *b) {
        long long n = 0;
        for (const struct fetch_part *p = b->parts; p; p = p->next)
                n += p->bytes;
        return n;
}
