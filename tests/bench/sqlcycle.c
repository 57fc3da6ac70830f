/* sqlcycle.c - the relay's lock, fetch and mark statements alone, no Kafka:
 * the ceiling the relay is measured against (tests/bench/run, rows 1 and 3).
 *
 * usage: outbox-bench-sqlcycle drain URL TABLE BATCH CLIENTS TOTAL
 *            CLIENTS threads, each with its own connection, repeat the
 *            relay's lock (relay/sql/lock.sql, the default ordering), its fetch and its mark with
 * every outcome PUBLISHED until TOTAL rows have been marked by all of them together.
 *        outbox-bench-sqlcycle lock URL TABLE BATCH REPS
 *            one client: REPS lock+fetch+mark cycles, each statement timed.
 *
 * Prints one line of key=value pairs on stdout; errors on stderr, exit 1.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "db.h"
#include "db_async.h"
#include "encode.h"
#include "relay_sql.h"

static const char *url, *table;
static int batch;
static long long total;
static atomic_llong marked;
static atomic_int failed;

struct client {
        int id;
        char rid[32];
        pthread_t th;
        long long rows, batches, empty;
        double lock_s, mark_s;
        double backend_cpu_s; /* the client's PostgreSQL backend, read at the end */
};

/* Appends s as an element of a PostgreSQL array literal. */
static int elem(struct buf *a, const char *s) {
        return (a->len > 1 && buf_append(a, ",", 1)) || buf_appendf(a, "\"%s\"", s);
}

/* One lock+fetch+mark cycle; returns rows locked or -1. */
static long cycle(struct db *db, const char *rid, double *lock_s, double *mark_s) {
        char err[512], lim[16];
        struct buf tids = {0}, ids = {0};
        long n = -1;
        snprintf(lim, sizeof lim, "%d", batch);
        const char *lp[6] = {rid, lim, "{}", "{}", "aggregate", "{}"};
        double t0 = clock_mono_s();
        struct db_result *lock = db_exec(db, RELAY_SQL_LOCK, 6, lp, 1, err, sizeof err);
        struct db_result *fetch = NULL, *mark = NULL;
        if (!lock || !db_result_ok(lock)) {
                fprintf(stderr, "sqlcycle: lock: %s\n", lock ? db_result_error(lock) : err);
                goto out;
        }
        n = db_result_rows(lock);
        if (buf_append(&tids, "{", 1) || buf_append(&ids, "{", 1))
                goto oom;
        for (int i = 0; i < n; i++) {
                char tid[DB_TID_TEXT], id[37];
                db_tid_text(db_result_value(lock, i, 0), db_result_length(lock, i, 0), tid);
                db_uuid_text(db_result_value(lock, i, 1), db_result_length(lock, i, 1), id);
                if (elem(&tids, tid) || elem(&ids, id))
                        goto oom;
        }
        if (buf_append(&tids, "}", 1) || buf_append(&ids, "}", 1))
                goto oom;
        if (n > 0) {
                const char *fp[6] = {tids.data, rid, "16777216", "1000000", "{}", "{}"};
                fetch = db_exec(db, RELAY_SQL_FETCH, 6, fp, 1, err, sizeof err);
                if (!fetch || !db_result_ok(fetch)) {
                        fprintf(stderr, "sqlcycle: fetch: %s\n",
                                fetch ? db_result_error(fetch) : err);
                        n = -1;
                        goto out;
                }
        }
        double t1 = clock_mono_s();
        *lock_s += t1 - t0;
        if (n > 0) {
                const char *mp[3] = {rid, tids.data, ids.data};
                mark = db_exec(db, RELAY_SQL_MARK_PUBLISHED, 3, mp, 1, err, sizeof err);
                if (!mark || !db_result_ok(mark) || db_result_rows(mark) != n) {
                        fprintf(stderr, "sqlcycle: mark: %s\n", mark ? db_result_error(mark) : err);
                        n = -1;
                        goto out;
                }
                *mark_s += clock_mono_s() - t1;
        }
        goto out;
oom:
        fprintf(stderr, "sqlcycle: out of memory\n");
        n = -1;
out:
        db_result_free(lock);
        db_result_free(fetch);
        db_result_free(mark);
        buf_free(&tids);
        buf_free(&ids);
        return n;
}

static struct db *open_db(const char *rid) {
        char err[512];
        struct db *db = db_new(url, table, rid);
        /* the relay's lock and mark sessions */
        struct db_session s = {.app_name = "outbox-relay:bench",
                               .statement_timeout_ms = 60000,
                               .lock_timeout_ms = 2000,
                               .fixed_plans = 1,
                               .sql = relay_sql,
                               .nsql = RELAY_SQL_COUNT,
                               .prepare = 1ULL << RELAY_SQL_LOCK | 1ULL << RELAY_SQL_FETCH |
                                          1ULL << RELAY_SQL_MARK_PUBLISHED};
        if (!db || db_async_configure(db, &s) != 0 || db_connect(db, err, sizeof err) != 0) {
                fprintf(stderr, "sqlcycle: connect: %s\n", db ? err : "out of memory");
                db_destroy(db);
                return NULL;
        }
        return db;
}

/* CPU seconds (user + system) a process on this machine has used so far. */
static double process_cpu_s(int pid) {
        char path[64];
        snprintf(path, sizeof path, "/proc/%d/stat", pid);
        FILE *f = fopen(path, "r");
        if (!f)
                return 0;
        char line[1024];
        double s = 0;
        if (fgets(line, sizeof line, f)) {
                /* fields 14 and 15 (utime, stime) count from after the ")" */
                const char *p = strrchr(line, ')');
                unsigned long long ut, st;
                if (p && sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut,
                                &st) == 2)
                        s = (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
        }
        fclose(f);
        return s;
}

static void *drain(void *arg) {
        struct client *c = arg;
        snprintf(c->rid, sizeof c->rid, "bench-sql-%d", c->id);
        struct db *db = open_db(c->rid);
        if (!db) {
                atomic_store(&failed, 1);
                return NULL;
        }
        while (atomic_load(&marked) < total && !atomic_load(&failed)) {
                long n = cycle(db, c->rid, &c->lock_s, &c->mark_s);
                if (n < 0) {
                        atomic_store(&failed, 1);
                        break;
                }
                if (n == 0) {
                        /* The guard can leave nothing due while the other
                         * client holds the heads of the aggregates. */
                        c->empty++;
                        struct timespec ts = {0, 200000};
                        nanosleep(&ts, NULL);
                        continue;
                }
                c->rows += n;
                c->batches++;
                atomic_fetch_add(&marked, n);
        }
        if (db_backend_pid(db))
                c->backend_cpu_s = process_cpu_s(db_backend_pid(db));
        db_destroy(db);
        return NULL;
}

static int cmp_double(const void *a, const void *b) {
        double x = *(const double *)a, y = *(const double *)b;
        return x < y ? -1 : x > y;
}

static int run_lock(int reps) {
        struct db *db = open_db("bench-sql-0");
        double *lock_ms = calloc((size_t)reps, sizeof *lock_ms);
        double *mark_ms = calloc((size_t)reps, sizeof *mark_ms);
        long long rows = 0;
        int rc = 1, done = 0;
        if (!db || !lock_ms || !mark_ms)
                goto out;
        for (; done < reps; done++) {
                double l = 0, m = 0;
                long n = cycle(db, "bench-sql-0", &l, &m);
                if (n < 0)
                        goto out;
                if (n == 0)
                        break;
                rows += n;
                lock_ms[done] = l * 1e3;
                mark_ms[done] = m * 1e3;
        }
        if (!done) {
                fprintf(stderr, "sqlcycle: nothing to lock\n");
                goto out;
        }
        double first = lock_ms[0];
        qsort(lock_ms, (size_t)done, sizeof *lock_ms, cmp_double);
        qsort(mark_ms, (size_t)done, sizeof *mark_ms, cmp_double);
        printf("reps=%d rows=%lld lock_first_ms=%.3f lock_median_ms=%.3f lock_min_ms=%.3f "
               "lock_max_ms=%.3f mark_median_ms=%.3f\n",
               done, rows, first, lock_ms[done / 2], lock_ms[0], lock_ms[done - 1],
               mark_ms[done / 2]);
        rc = 0;
out:
        free(lock_ms);
        free(mark_ms);
        db_destroy(db);
        return rc;
}

static int usage(void) {
        fprintf(stderr, "usage: outbox-bench-sqlcycle drain URL TABLE BATCH CLIENTS TOTAL\n"
                        "       outbox-bench-sqlcycle lock URL TABLE BATCH REPS\n");
        return 2;
}

int main(int argc, char **argv) {
        if (argc < 6)
                return usage();
        url = argv[2];
        table = argv[3];
        batch = atoi(argv[4]);
        if (batch < 1)
                return usage();
        if (strcmp(argv[1], "lock") == 0 && argc == 6)
                return run_lock(atoi(argv[5]));
        if (strcmp(argv[1], "drain") != 0 || argc != 7)
                return usage();
        int clients = atoi(argv[5]);
        total = atoll(argv[6]);
        if (clients < 1 || clients > 64 || total < 1)
                return usage();
        struct client *cs = calloc((size_t)clients, sizeof *cs);
        if (!cs)
                return 1;
        double t0 = clock_mono_s();
        for (int i = 0; i < clients; i++) {
                cs[i].id = i;
                if (pthread_create(&cs[i].th, NULL, drain, &cs[i]) != 0) {
                        fprintf(stderr, "sqlcycle: pthread_create failed\n");
                        return 1;
                }
        }
        long long rows = 0, batches = 0, empty = 0;
        double lock_s = 0, mark_s = 0, backend_cpu_s = 0;
        for (int i = 0; i < clients; i++) {
                pthread_join(cs[i].th, NULL);
                rows += cs[i].rows;
                batches += cs[i].batches;
                empty += cs[i].empty;
                lock_s += cs[i].lock_s;
                mark_s += cs[i].mark_s;
                backend_cpu_s += cs[i].backend_cpu_s;
        }
        double el = clock_mono_s() - t0;
        free(cs);
        if (atomic_load(&failed))
                return 1;
        printf("clients=%d rows=%lld seconds=%.3f rows_per_s=%.0f batches=%lld empty_locks=%lld "
               "lock_ms_avg=%.3f mark_ms_avg=%.3f backend_cpu_s=%.2f\n",
               clients, rows, el, (double)rows / el, batches, empty,
               batches ? lock_s * 1e3 / (double)batches : 0.0,
               batches ? mark_s * 1e3 / (double)batches : 0.0, backend_cpu_s);
        return 0;
}
