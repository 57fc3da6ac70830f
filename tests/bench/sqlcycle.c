/* sqlcycle.c - the relay's lock/mark SQL cycle alone, no Kafka: the ceiling
 * the relay is measured against (tests/bench/run, row 1 and 3).
 *
 * usage: outbox-bench-sqlcycle drain URL TABLE BATCH CLIENTS TOTAL
 *            CLIENTS threads, each with its own connection, repeat the
 *            relay's lock (aggregate guard on, as the relay's default)
 *            and db_mark() with every outcome PUBLISHED until TOTAL rows
 *            have been marked by all of them together.
 *        outbox-bench-sqlcycle lock URL TABLE BATCH REPS
 *            one client: REPS lock+mark cycles, each statement timed.
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

static const char *url, *table;
static int batch;
static long long total;
static atomic_llong marked;
static atomic_int failed;

struct client {
        int id;
        pthread_t th;
        long long rows, batches, empty;
        double lock_s, mark_s;
        double backend_cpu_s; /* the client's PostgreSQL backend, read at the end */
};

/* After a top-up that found nothing, how long not to try again (as the relay). */
#define TOPUP_PAUSE_S 1.0
/* The relay's default OUTBOX_BATCH_BYTES. */
#define BENCH_BATCH_BYTES 16777216LL

/* The relay's lock of a batch without a lock ahead (relay/claims.c): the
 * window under the guard, topped up with aggregates' heads when short. */
static int lock_batch(struct db *db, struct db_batch *b, double *topup_after, char *err,
                      size_t size) {
        int unknown;
        if (db_lock(db, DB_LOCK_RUNS, batch, BENCH_BATCH_BYTES, b, &unknown, err, size) != 0)
                return -1;
        size_t got = b->count;
        if (got < (size_t)batch && clock_mono_s() >= *topup_after) {
                if (db_lock(db, DB_LOCK_HEADS, batch - (int)got, BENCH_BATCH_BYTES, b, &unknown,
                            err, size) != 0)
                        return -1;
                if (b->count == got)
                        *topup_after = clock_mono_s() + TOPUP_PAUSE_S;
        }
        return 0;
}

/* One lock+mark cycle; returns rows locked or -1. */
static long cycle(struct db *db, struct db_outcome *outs, double *topup_after, double *lock_s,
                  double *mark_s) {
        char err[512];
        struct db_batch b = {0};
        double t0 = clock_mono_s();
        if (lock_batch(db, &b, topup_after, err, sizeof err) != 0) {
                fprintf(stderr, "sqlcycle: %s\n", err);
                db_batch_clear(&b);
                return -1;
        }
        double t1 = clock_mono_s();
        *lock_s += t1 - t0;
        size_t n = b.count;
        if (n) {
                for (size_t i = 0; i < n; i++) {
                        memset(&outs[i], 0, sizeof outs[i]);
                        outs[i].outbox_id = b.events[i].outbox_id;
                        outs[i].tid = b.events[i].tid;
                        outs[i].mark = DB_MARK_PUBLISHED;
                }
                size_t lost = 0;
                if (db_mark(db, outs, n, &lost, err, sizeof err) != 0 || lost) {
                        fprintf(stderr, "sqlcycle: mark: %s lost=%zu\n", err, lost);
                        db_batch_clear(&b);
                        return -1;
                }
                *mark_s += clock_mono_s() - t1;
        }
        db_batch_clear(&b);
        return (long)n;
}

static struct db *open_db(int id) {
        char err[512], rid[32];
        snprintf(rid, sizeof rid, "bench-sql-%d", id);
        struct db *db = db_new(url, table, rid);
        if (!db || db_connect(db, err, sizeof err) != 0) {
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
        struct db *db = open_db(c->id);
        struct db_outcome *outs = calloc((size_t)batch, sizeof *outs);
        double topup_after = 0;
        if (!db || !outs) {
                atomic_store(&failed, 1);
                goto out;
        }
        while (atomic_load(&marked) < total && !atomic_load(&failed)) {
                long n = cycle(db, outs, &topup_after, &c->lock_s, &c->mark_s);
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
out:
        if (db && db_backend_pid(db))
                c->backend_cpu_s = process_cpu_s(db_backend_pid(db));
        free(outs);
        db_destroy(db);
        return NULL;
}

static int cmp_double(const void *a, const void *b) {
        double x = *(const double *)a, y = *(const double *)b;
        return x < y ? -1 : x > y;
}

static int run_lock(int reps) {
        struct db *db = open_db(0);
        struct db_outcome *outs = calloc((size_t)batch, sizeof *outs);
        double *lock_ms = calloc((size_t)reps, sizeof *lock_ms);
        double *mark_ms = calloc((size_t)reps, sizeof *mark_ms);
        long long rows = 0;
        double topup_after = 0;
        int rc = 1, done = 0;
        if (!db || !outs || !lock_ms || !mark_ms)
                goto out;
        for (; done < reps; done++) {
                double l = 0, m = 0;
                long n = cycle(db, outs, &topup_after, &l, &m);
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
        free(outs);
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
