/* relay.c - the relay's loop: one poll() over three database connections and
 * the producer, deadlines for everything timed. Each turn is a list of named
 * steps; nothing below the loop sleeps, retries or reads the stop flag. */
#include "relay.h"

#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "batch.h"
#include "clock.h"
#include "db_async.h"
#include "decide.h"
#include "health.h"
#include "indexes.h"
#include "kafka.h"
#include "kafka_stats.h"
#include "lifecycle.h"
#include "log.h"
#include "message.h"
#include "metrics.h"
#include "relay_sql.h"

/* Batches in flight at most: the rows a relay holds stay below this many
 * batches' worth (and OUTBOX_BATCH_BYTES). */
#define MAX_BATCHES 4
/* Rows another transaction holds, in batches, that do not count against
 * MAX_BATCHES (lock_limit()): each keeps its batch's row records and lock
 * answer, not its content. */
#define HELD_ROWS_MAX 16
/* Lock statements in flight at most (each a batch, however few its rows):
 * a batch is done once all its rows are, so when a stopped broker holds one
 * row of each small batch, the others' partitions keep going until the
 * rows, not the batches, run out. */
#define MAX_BATCH_OBJECTS 256
/* The most text one fetch brings (rows beyond it are fetched next). */
#define FETCH_BYTES_MAX (4LL << 20)
/* The first lock after start or a reconnect takes at most this many rows,
 * each one after it LOCK_RAMP times as many, up to a batch: the first events
 * of a backlog wait for a small lock, not a batch's. Every lock grows it,
 * whatever it found: a small window full of versions that may not go yet
 * (behind a DEAD or failing one) must not keep the window small. */
#define LOCK_FIRST_ROWS 16
#define LOCK_RAMP       4
/* At start, side work waits for the first lock's answer at most this long. */
#define SIDE_FIRST_WAIT_S 1.0
/* Outcomes wait this long for others to share their mark statement. */
#define MARK_LINGER_S 0.002
/* After a lock that did not fill its batch, the next waits at least this
 * long (and for a reason: a NOTIFY, a mark, the poll interval). At low rates
 * it is part of every event's latency (half of it on average); shorter, each
 * lock statement finds fewer rows. 2 ms against 5: p99 at 1000 events/s
 * 12.9 against 16.3 ms, PostgreSQL CPU per event in a burst within 4 %. */
#define LOCK_AGAIN_S 0.002
/* librdkafka may report a message's timeout up to about a second late, and
 * does not time out messages sent just before every broker went away until
 * it reconnects: past the delivery timeout plus this, the producer's
 * messages are purged (reported failed, retriable). */
#define DELIVERY_SLACK_S 10.0
/* After a stop request, how long marks and take-backs keep trying a lost
 * database (then the sweeper returns what is left). */
#define STOP_GRACE_S 30.0
/* The longest a failing statement waits before it is tried again: work
 * resumes within this of the cause's end (an index rebuilt, a load gone). */
#define RETRY_CAP_MS 10000
/* The same after a lock timeout (55P03): each attempt already waited
 * OUTBOX_DB_LOCK_TIMEOUT_MS in the lock queue, which costs the server
 * nothing, so the next waits again almost at once and work resumes within
 * this of the lock's release, however long it was held. */
#define LOCK_WAIT_RETRY_CAP_MS 500
/* Database reconnects: 100 ms doubling to 5 s. */
#define RECONNECT_MIN_MS 100
#define RECONNECT_MAX_MS 5000
/* The table sample: every 10 s, or 50 times as long as the last took (a
 * large backlog makes the count slow: sampling stays about 2 % of the time),
 * but never more than 120 s after the last ended: a sample slowed by a
 * passing overload must not leave the gauges, which the alerts read, stale
 * for many minutes after it. */
#define SAMPLE_INTERVAL_S 10.0
#define SAMPLE_SPACING    50.0
#define SAMPLE_WAIT_MAX_S 120.0
/* Parked versions made due again per sample, at most (the rest at the next). */
#define UNPARK_LIMIT 10000
/* A statement waiting this long on the lock or mark connection has its
 * blockers looked up and logged; on one connection at most once in
 * BLOCKED_REPEAT_S: a long-held lock, waited for by attempt after attempt
 * (each gives up after the lock timeout and the next follows within
 * LOCK_WAIT_RETRY_CAP_MS), is named every so often, not at each attempt. */
#define BLOCKED_REPORT_S 1.0
#define BLOCKED_REPEAT_S 30.0

/* The longest pause of the lock while every outcome is a failure that
 * says nothing about the rows: how late a relay notices the cause (a schema
 * registry) is back, against the database work each batch that fails
 * anyway costs (a lock and a mark per row). */
#define UNCOUNTED_PAUSE_MAX_S 10.0

/* How often rows another transaction holds are asked about again
 * (mark_probe.sql): each ask reads them, never waits. */
#define PROBE_REPEAT_S 1.0
/* The lock window leaves out the aggregates this relay has a run of
 * versions in flight for, and those whose row has been in flight this long
 * (a slow or stopped broker's partitions): the guard holds their queued
 * versions until the row in flight is marked, and held rows at the window's
 * head would keep every other aggregate's rows out of it. Rows in flight for
 * less than this are acknowledged soon: leaving their aggregates in keeps
 * the list, which the window scans for every row it reads, short. */
#define STUCK_S 0.5
/* A version gap is reported once it has held its aggregate this long;
 * gaps logged per sample at most; each logged once (remembered by hash). */
#define GAP_REPORT_AFTER_S 5
#define GAP_LOG_MAX        20
#define GAP_SEEN_MAX       1024
/* A transaction older than this that holds rows back is named. */
#define HORIZON_REPORT_S 10.0
/* Rows one take-back statement returns at most. */
#define TAKE_BACK_LIMIT 10000

enum { C_LOCK, C_MARK, C_SIDE, C_COUNT };
static const char *const conn_names[C_COUNT] = {"lock", "mark", "side"};

/* The readiness conditions the loop sets (health.c adds lock, mark, stall). */
enum { H_DATABASE, H_TABLE, H_KAFKA, H_STATEMENTS, H_COUNT };
static const char *const health_names[H_COUNT] = {"database", "table", "kafka", "statements"};

/* One database connection of the relay. */
struct conn {
        struct db *db;
        double retry_at; /* no connect before this (backoff) */
        int backoff_ms;
        int failures;        /* connects failed in a row */
        int restarting;      /* closed on purpose: a fresh session cures a statement */
        unsigned downs;      /* conn_down() calls, so that a loss is handled once */
        int logged_stopping; /* the last line logged was after the stop request */
        char why[512];
};

/* One statement's failures in a row, for its backoff and readiness. */
struct stmt_state {
        int failures;
        double retry_at;
        char sqlstate[6];
        char error[200];
};

/* What the side connection runs. */
enum side_task {
        SIDE_IDLE,
        SIDE_TAKE_BACK,
        SIDE_SAMPLE,
        SIDE_GAPS,
        SIDE_HELD,
        SIDE_HORIZON,
        SIDE_UNPARK,
        SIDE_BLOCKERS,
        SIDE_INDEXES
};

struct relay {
        const struct config *cfg;
        struct http *http;
        struct health *health;
        struct message *message;
        struct kafka *kafka;
        struct conn conns[C_COUNT];
        struct stmt_state stmts[RELAY_SQL_COUNT];
        int lock_stmt;                /* enum relay_sql: the lock statement of OUTBOX_ORDERING */
        struct batch *batches, *last; /* oldest first */
        size_t nbatches;
        long long rows_open; /* locked, not yet marked */
        long long bytes_held;
        double row_bytes; /* recent rows' average size (0: none yet) */

        /* locking and fetching (the lock connection) */
        int lock_wanted;        /* something may have become due: lock soon */
        double next_lock;       /* lock at the latest then (the poll interval) */
        double lock_not_before; /* after a short batch, not before this */
        /* failures that say nothing about the rows (REGISTRY_UNAVAILABLE,
         * OUT_OF_MEMORY) with no event published since: since when, and the
         * lock paused until when (uncounted_failed()) */
        double uncounted_since, uncounted_last, lock_paused_until;
        int pause_said;         /* a warn line said locking is paused */
        int lock_limit;         /* the lock statement in flight asked for this many */
        int lock_ramp;          /* the next lock takes at most this many rows */
        int holding_full;       /* the last lock was skipped: holding as many as it may */
        double side_not_before; /* side work waits for the first lock (or this time) */
        long lock_gen;          /* db_connects() of the lock connection when it was sent */
        double lock_sent_at;    /* when it was sent (monotonic): its rows' lock age starts */
        struct batch *fetching; /* the batch the fetch in flight is for */
        int fetch_alone;        /* the fetch in flight asked for one suspect alone */
        int fetch_by_id;        /* the fetch in flight finds its rows by outbox_id */
        long long fetch_budget; /* the byte limit the fetch in flight was sent */
        /* The batch whose rows a fetch by ctid did not find: an UPDATE moved
         * them since their lock (or the sweeper took them). Its rows still
         * to fetch are looked up by outbox_id from then on (free_done()
         * forgets it with the batch). */
        struct batch *moved;
        struct buf list, list2; /* parameter text */
        struct buf list3;       /* the aggregates left out whole */
        long long *hot;         /* their keys (as many as rows held, at most) */
        size_t hot_cap;

        /* marking (the mark connection) */
        struct row **marking; /* the rows of the mark statement in flight */
        size_t nmarking, marking_cap;
        int marking_stmt;
        struct buf mp[6];      /* its array parameters */
        double oldest_settled; /* when the oldest outcome waiting for a mark came (0: none) */
        double oldest_free;    /* the same among the rows no other transaction holds */
        double next_probe;     /* when mark_probe asks about held rows again (0: none held) */
        long long rows_held_by_other; /* outcomes left out of marks (held, or behind one) */
        long long rows_locked;        /* of those, the ones a probe found row-locked */
        long long nheld;              /* rows with held_by_other set (as the last probes found) */
        double held_logged_at;        /* when that was last logged at warn */
        long long held_logged;        /* how many rows it said were held */
        size_t lost_n;                /* rows of the answer in hand whose lock was lost */
        char lost_first[37];          /* the first of them */
        int held_said; /* a warn line said rows are held, none said since that none are */

        /* the side connection */
        enum side_task side_task;
        double parked_seen;        /* versions parked behind a DEAD one, at the last sample */
        long long parked_unlogged; /* versions this relay parked, not yet logged */
        double parked_logged_at;
        int take_back_wanted; /* rows may be PUBLISHING under this id that no batch has */
        /* index checks (indexes.sql) asked for, and that count when the last
         * one was sent: one asked while one runs (the catalog it read may be
         * older than what made a lock statement time out) is sent after it */
        unsigned indexes_asks, indexes_sent, indexes_done;
        /* times a take-back was wanted, and that count when the last one
         * was sent: a want that comes while one runs (a lock answer lost
         * meanwhile, whose rows are newer than its connection) outlives it */
        unsigned take_back_asks, take_back_sent;
        double next_sample, sample_started;
        int sample_slow;
        int sample_after_lock; /* the chain gave up on the table's lock: again after a lock */
        long long gap_keys[GAP_LOG_MAX], gap_held[GAP_LOG_MAX]; /* gaps: keys, held versions */
        size_t ngap_keys;
        unsigned long long gaps_seen[GAP_SEEN_MAX];
        size_t ngaps_seen;
        int horizon_pid;        /* the long transaction named last (0: none) */
        double blockers_for[2]; /* the statement start whose blockers were logged (lock, mark) */
        double blockers_at[2];  /* when they were last looked up (lock, mark) */
        int blockers_conn;

        /* stopping */
        int stopping;
        double stop_deadline; /* set once the database must be reached to finish */
        int purged;
        int too_old;
        char too_old_why[512]; /* the server version line, from the connection that learnt it */
        int fatal;
        unsigned seed;
        struct kafka_stats_seen stats_seen;
};

/* ---- small helpers ---------------------------------------------------- */

static struct db *db_of(struct relay *r, int c) {
        return r->conns[c].db;
}

static int idle(struct relay *r, int c) {
        return db_async_phase(db_of(r, c)) == DB_IDLE;
}

/* Appends s to a PostgreSQL array literal being built in b ("{" first). */
static int array_add(struct buf *b, const char *s) {
        if (b->len > 1 && buf_append(b, ",", 1))
                return -1;
        if (!s)
                return buf_append(b, "NULL", 4);
        if (buf_append(b, "\"", 1))
                return -1;
        for (;;) {
                size_t run = strcspn(s, "\"\\");
                if (buf_append(b, s, run))
                        return -1;
                s += run;
                if (!*s)
                        break;
                if (buf_append(b, "\\", 1) || buf_append(b, s, 1))
                        return -1;
                s++;
        }
        return buf_append(b, "\"", 1);
}

/* ---- statements: failures, backoff and readiness --------------------- */

/* A statement answered: if it had been failing, says it works again. */
static void stmt_ok(struct relay *r, int stmt) {
        struct stmt_state *st = &r->stmts[stmt];
        if (st->failures >= 1)
                log_info("db", "statement works again", "statement=%s failures=%d",
                         relay_sql[stmt].name, st->failures);
        st->failures = 0;
        st->retry_at = 0;
        st->sqlstate[0] = '\0';
}

/* A statement failed with an error from the server. Logs when it starts
 * failing or its SQLSTATE changes (not every attempt), backs it off, and
 * drops the connection when a fresh session cures it. */
static void stmt_failed(struct relay *r, int c, int stmt, const struct db_result *res, double now) {
        struct stmt_state *st = &r->stmts[stmt];
        const char *state = db_result_sqlstate(res);
        enum db_fault fault = db_fault_of(state);
        st->failures++;
        int retry = decide_retry_ms(st->failures,
                                    strcmp(state, "55P03") ? RETRY_CAP_MS : LOCK_WAIT_RETRY_CAP_MS);
        st->retry_at = now + retry / 1000.0;
        metrics_add2(M_STATEMENT_ERRORS, relay_sql[stmt].name, state, 1);
        int starts = st->failures == 1 || strcmp(st->sqlstate, state) != 0;
        if (starts)
                log_warn("db", "statement failing", "statement=%s sqlstate=%s retry_ms=%d err=%s",
                         relay_sql[stmt].name, state, retry, db_result_error(res));
        /* a lock statement that starts to time out may have lost an index
         * it is written for (dropped, or rebuilt and left invalid): the
         * index check says so, once per such start */
        int lock = stmt == RELAY_SQL_LOCK || stmt == RELAY_SQL_LOCK_NONE;
        if (lock && starts && !strcmp(state, "57014"))
                r->indexes_asks++;
        snprintf(st->sqlstate, sizeof st->sqlstate, "%s", state);
        snprintf(st->error, sizeof st->error, "%s", db_result_error(res));
        if (fault == DB_FAULT_SESSION) {
                /* a new session prepares the statements again and resolves
                 * the table anew: the first time at once, then with the
                 * statement's backoff */
                log_info("db", "opening a new session: it prepares the statements again",
                         "connection=%s statement=%s sqlstate=%s", conn_names[c],
                         relay_sql[stmt].name, state);
                db_async_close(db_of(r, c));
                r->conns[c].restarting = 1;
                r->conns[c].retry_at = st->failures == 1 ? now : st->retry_at;
        }
}

static int stmt_may_run(const struct relay *r, int stmt, double now) {
        return now >= r->stmts[stmt].retry_at;
}

/* Rows may be PUBLISHING under this relay id that no batch has: the side
 * connection takes them back once the lock connection is up. */
static void want_take_back(struct relay *r) {
        r->take_back_wanted = 1;
        r->take_back_asks++;
}

/* ---- connections ------------------------------------------------------ */

static void lock_result(struct relay *r, struct db_result *res, double now);
static void fetch_result(struct relay *r, struct db_result *res, double now);
static void row_done(struct relay *r, struct row *w, int lost);
static void log_lost(struct relay *r, const char *msg);
static void mark_result(struct relay *r, struct db_result *res, double now);
static void side_result(struct relay *r, struct db_result *res, double now);
static void read_failed(struct relay *r, struct batch *b, const char *sqlstate, const char *why);

/* The lock connection was lost while a fetch of b ran (its answer says so:
 * a statement running when the connection goes answers). A row whose text
 * kills the server process that computes it (a crash, or an operator's
 * pg_terminate_backend each time) would otherwise be fetched again for
 * ever, its attempts never spent, the server restarting every time: the
 * batch's rows are read one at a time, and a loss while one row is read
 * alone counts as a failed read of it (READ_FAILED: an attempt spent, a
 * backoff, DEAD once its attempts are used up). */
static void fetch_lost(struct relay *r, struct batch *b) {
        if (r->fetch_alone) {
                read_failed(r, b, "",
                            "the database connection was lost while this row alone was read "
                            "(a row whose read ends the server process?)");
                return;
        }
        log_warn("relay", "a fetch lost the connection: reading its rows one at a time", "rows=%zu",
                 batch_suspect_asked(b));
}

/* The answer to the statement on the mark connection will not be read (the
 * connection was lost, or the answer cannot be held): whether it marked its
 * rows is unknown. They are marked again, and one it did mark is then not
 * counted as a lost lock (a probe marks nothing). */
static void marking_unknown(struct relay *r) {
        for (size_t i = 0; i < r->nmarking; i++) {
                r->marking[i]->stage = ROW_SETTLED;
                if (r->marking_stmt != RELAY_SQL_MARK_PROBE)
                        r->marking[i]->mark_uncertain = 1;
        }
        r->nmarking = 0;
}

/* Connection c went down (failed to connect, or was lost): back off. */
static void conn_down(struct relay *r, int c, const char *why, double now) {
        struct conn *cn = &r->conns[c];
        struct db *db = cn->db;
        cn->downs++;
        if (cn->restarting) {
                cn->restarting = 0; /* closed on purpose: retry_at is set */
                goto forget;
        }
        cn->failures++;
        int retry = cn->backoff_ms;
        if (r->stopping)
                retry = LIFECYCLE_STOP_RETRY_MS;
        cn->retry_at = now + retry / 1000.0;
        cn->backoff_ms =
                cn->backoff_ms * 2 > RECONNECT_MAX_MS ? RECONNECT_MAX_MS : cn->backoff_ms * 2;
        if (db_async_too_old(db) && !r->too_old) {
                r->too_old = 1; /* whichever connection learnt it first says why */
                snprintf(r->too_old_why, sizeof r->too_old_why, "%s", why);
        }
        /* one line per state change: a new error, or the pause a stop
         * request changed (the line says the pause really taken) */
        if (cn->failures == 1 || strcmp(cn->why, why) != 0 || cn->logged_stopping != r->stopping) {
                log_warn("db",
                         db_async_table_missing(db)  ? "table missing, retrying"
                         : db_async_table_locked(db) ? "table locked by another session, retrying"
                                                     : "database connection down, retrying",
                         "connection=%s retry_ms=%d err=%s", conn_names[c], retry, why);
                cn->logged_stopping = r->stopping;
        }
        snprintf(cn->why, sizeof cn->why, "%s", why);
forget:
        if (c == C_LOCK) {
                r->fetching = NULL; /* fetched again on the next connection */
                r->lock_ramp = LOCK_FIRST_ROWS;
        }
        if (c == C_MARK)
                marking_unknown(r);
        if (c == C_SIDE)
                r->side_task = SIDE_IDLE;
}

/* Reads what connection c has for us and handles it. */
static void pump(struct relay *r, int c, double now) {
        char err[512];
        struct conn *cn = &r->conns[c];
        enum db_event ev = db_async_advance(cn->db, now, err, sizeof err);
        if (ev == DB_EV_UP) {
                if (cn->failures || c == C_LOCK)
                        log_info("db", "connected", "connection=%s table=%s", conn_names[c],
                                 db_table_name(cn->db));
                cn->failures = 0;
                cn->backoff_ms = RECONNECT_MIN_MS;
                cn->why[0] = '\0';
                if (c == C_LOCK) {
                        /* rows may be PUBLISHING under this relay id from
                         * before this connection: an earlier process's, or a
                         * lock whose answer a lost connection took */
                        want_take_back(r);
                        r->lock_wanted = 1;
                }
        } else if (ev == DB_EV_RESULT) {
                struct db_result *res = db_async_result(cn->db);
                if (!res) /* db_async_advance gives a result with this event */
                        return;
                unsigned downs = cn->downs;
                if (c == C_LOCK)
                        r->fetching ? fetch_result(r, res, now) : lock_result(r, res, now);
                else if (c == C_MARK)
                        mark_result(r, res, now);
                else
                        side_result(r, res, now);
                /* the handler may have met the loss first (a statement it
                 * sent failed) and counted it */
                if (db_async_phase(cn->db) == DB_DOWN && cn->downs == downs)
                        conn_down(r, c, "connection lost", now);
        } else if (ev == DB_EV_DOWN) {
                conn_down(r, c, err, now);
        }
}

/* Step: connect what is down (after its backoff), move every connection on. */
static void keep_connections(struct relay *r, double now) {
        char err[512];
        for (int c = 0; c < C_COUNT; c++) {
                struct conn *cn = &r->conns[c];
                if (db_async_phase(cn->db) == DB_DOWN && now >= cn->retry_at) {
                        if (db_async_start(cn->db, now, err, sizeof err) != 0)
                                conn_down(r, c, err, now);
                }
                if (db_async_phase(cn->db) != DB_DOWN)
                        pump(r, c, now);
        }
}

/* ---- the producer ------------------------------------------------------ */

/* A delivery report: the row's outcome. */
static void on_delivery(void *opaque, const struct kafka_result *res, void *ctx) {
        struct relay *r = ctx;
        struct row *w = opaque;
        struct batch *b = w->batch;
        size_t i = (size_t)(w - b->rows);
        if (res->ok) {
                metrics_add(M_EVENTS_PUBLISHED, w->topic, 1);
                double latency = clock_wall_s() - w->ev.occurred_at_epoch;
                if (latency >= 0 && latency < 1e9)
                        metrics_observe(M_PUBLISH_LATENCY, latency);
                kafka_set_broker_up(r->kafka, 1);
                batch_settle(b, i, DECIDE_PUBLISHED, NULL, NULL);
                if (r->uncounted_since > 0 && r->pause_said)
                        log_info("relay", "events published again: locking at the usual pace",
                                 "paused_s=%.1f", clock_mono_s() - r->uncounted_since);
                r->uncounted_since = 0;
                r->lock_paused_until = 0;
                r->pause_said = 0;
                return;
        }
        w->permanent = res->permanent;
        batch_settle(b, i,
                     decide_failure(res->permanent, 0, w->ev.attempt_count, r->cfg->max_attempts),
                     res->code, res->message);
}

/* librdkafka's statistics: the brokers that are up (readiness) and the
 * exported numbers (kafka_stats.c). */
static void on_stats(const char *json, size_t len, void *ctx) {
        struct relay *r = ctx;
        struct kafka_stats st;
        char err[256];
        if (kafka_stats_parse(json, len, &st, err, sizeof err) != 0) {
                log_debug("kafka", "statistics not understood", "err=%s", err);
                return;
        }
        kafka_set_broker_up(r->kafka, st.brokers_up > 0);
        if (kafka_stats_apply(&st, &r->stats_seen) != 0)
                log_debug("kafka", "statistics not exported", NULL);
}

/* Rebuilds the producer after a fatal error (idempotence state lost), once
 * every message it had was reported. -1 when it cannot be rebuilt. */
static int rebuild_producer(struct relay *r) {
        char err[512];
        kafka_fatal(r->kafka, err, sizeof err);
        log_error("kafka", "rebuilding the producer", "reason=%s", err);
        kafka_destroy(r->kafka);
        r->kafka = kafka_new(r->cfg, on_delivery, on_stats, r, err, sizeof err);
        if (!r->kafka) {
                log_error("kafka", "cannot rebuild the producer", "reason=%s", err);
                return -1;
        }
        r->purged = 0;
        memset(&r->stats_seen, 0, sizeof r->stats_seen); /* its totals start from zero */
        return 0;
}

/* Step: delivery reports, errors and statistics; a fatal producer error
 * purges what is outstanding and rebuilds the producer once it is all
 * reported; messages owed past the delivery timeout are purged. */
static void serve_kafka(struct relay *r, double now) {
        char err[512];
        kafka_serve(r->kafka);
        int fatal = kafka_fatal(r->kafka, err, sizeof err);
        if (fatal && !r->purged) {
                kafka_purge(r->kafka);
                r->purged = 1;
        }
        double oldest = now;
        for (struct batch *b = r->batches; b; b = b->next)
                for (size_t i = 0; i < b->n; i++)
                        if (b->rows[i].stage == ROW_PRODUCED && b->rows[i].produced_at < oldest)
                                oldest = b->rows[i].produced_at;
        if (!r->purged &&
            now - oldest > kafka_delivery_timeout_ms(r->kafka) / 1000.0 + DELIVERY_SLACK_S) {
                kafka_purge(r->kafka);
                r->purged = 1;
        }
        if (r->purged && kafka_outstanding(r->kafka) == 0) {
                if (fatal && rebuild_producer(r) != 0)
                        r->fatal = 1;
                r->purged = 0;
        }
}

/* ---- producing ---------------------------------------------------------- */

/* The longest a row may wait between its lock and its produce: its
 * delivery report must come, and its mark after it, before the sweeper
 * takes the lock back (OUTBOX_LOCK_TIMEOUT_S; the relay refuses a delivery
 * timeout that does not leave 30 s for this at start). */
static double produce_deadline_s(const struct relay *r) {
        double d = r->cfg->lock_timeout_s - kafka_delivery_timeout_ms(r->kafka) / 1000.0 - 20.0;
        return d > 5.0 ? d : 5.0;
}

/* A row failed for a cause outside it that no attempt counts against (the
 * schema registry unavailable, memory short). While every outcome is such a
 * failure, each batch would fail alike, at the pace of the lock: the lock
 * pauses, for as long as the failures have gone on, at most
 * UNCOUNTED_PAUSE_MAX_S, until an event is published again. */
static void uncounted_failed(struct relay *r, const char *code, double now) {
        /* below the readiness's stall bound: the pause is the relay's own */
        double cap = (2.0 * r->cfg->poll_interval_ms + r->cfg->statement_timeout_ms) / 2000.0;
        if (cap > UNCOUNTED_PAUSE_MAX_S)
                cap = UNCOUNTED_PAUSE_MAX_S;
        /* a failure long after the last one (the rows published by another
         * relay meanwhile, or traffic low) starts a new run of them */
        if (r->uncounted_since == 0 || now - r->uncounted_last > 2 * cap + 1.0) {
                r->uncounted_since = now;
                r->pause_said = 0;
        }
        r->uncounted_last = now;
        double pause = now - r->uncounted_since;
        if (pause > cap)
                pause = cap;
        if (now + pause > r->lock_paused_until)
                r->lock_paused_until = now + pause;
        if (pause >= (cap < 1.0 ? cap : 1.0) && !r->pause_said) {
                r->pause_said = 1;
                log_warn("relay",
                         "every event fails for a cause outside the rows: locking less often",
                         "err=%s failing_s=%.1f pause_max_s=%.1f", code, now - r->uncounted_since,
                         cap);
        }
}

/* Produces row i of b; settles it when it cannot go. 1 when the producer's
 * queue is full (try again after some reports), else 0. */
static int produce_row(struct relay *r, struct batch *b, size_t i, double now) {
        struct row *w = &b->rows[i];
        struct message_parts m;
        struct message_error why;
        int built = message_build(r->message, &w->ev, &m, &why);
        /* the topic outlives the message: the delivery report's metrics and
         * the log name it */
        if (m.topic && !w->topic && !(w->topic = strdup(m.topic))) {
                w->uncounted = 1; /* as message_build's OUT_OF_MEMORY */
                uncounted_failed(r, "OUT_OF_MEMORY", now);
                batch_settle(b, i, DECIDE_FAILED, "OUT_OF_MEMORY", "out of memory");
                return 0;
        }
        if (built != 0) {
                w->permanent = why.permanent;
                w->uncounted = why.uncounted;
                if (why.uncounted)
                        uncounted_failed(r, why.code, now);
                batch_settle(b, i,
                             decide_failure(why.permanent, why.uncounted, w->ev.attempt_count,
                                            r->cfg->max_attempts),
                             why.code, why.text);
                return 0;
        }
        struct kafka_result res;
        int rc = kafka_produce(r->kafka, m.topic, m.key, m.key_len, m.value, m.value_len, m.headers,
                               m.header_count, w, &res);
        if (rc == KAFKA_FULL)
                return 1;
        if (rc != 0) {
                w->permanent = res.permanent;
                batch_settle(
                        b, i,
                        decide_failure(res.permanent, 0, w->ev.attempt_count, r->cfg->max_attempts),
                        res.code, res.message);
                return 0;
        }
        metrics_observe(M_EVENT_SIZE, (double)m.value_len);
        w->stage = ROW_PRODUCED;
        w->produced_at = now;
        batch_release_content(b, i); /* the producer copied the message */
        return 0;
}

/* Step: every fetched row whose predecessor in its run was acknowledged
 * goes to the producer; a row whose predecessor failed is given back, as is
 * every row not yet produced once the relay stops or its lock grew too old. */
static void produce(struct relay *r, double now) {
        double deadline = produce_deadline_s(r);
        for (struct batch *b = r->batches; b; b = b->next) {
                if (!b->dirty)
                        continue;
                b->dirty = 0;
                for (size_t i = 0; i < b->n; i++) {
                        struct row *w = &b->rows[i];
                        if (w->stage != ROW_READY && w->stage != ROW_LOCKED)
                                continue;
                        const struct row *p = w->prev >= 0 ? &b->rows[w->prev] : NULL;
                        if (p && p->stage >= ROW_SETTLED && p->mark != DECIDE_PUBLISHED) {
                                batch_settle(b, i, DECIDE_RELEASED, NULL, NULL);
                                continue;
                        }
                        if (r->stopping || r->fatal || now - b->locked_at > deadline) {
                                batch_settle(b, i, DECIDE_RELEASED, NULL, NULL);
                                continue;
                        }
                        if (w->stage != ROW_READY || (p && p->stage < ROW_SETTLED) || r->purged)
                                continue;
                        if (produce_row(r, b, i, now)) {
                                b->dirty = 1; /* the producer's queue is full */
                                return;
                        }
                }
        }
}

/* ---- locking and fetching (the lock connection) --------------------------- */

/* Orders aggregate keys (long long) ascending. */
static int by_key(const void *a, const void *b) {
        long long x = *(const long long *)a, y = *(const long long *)b;
        return (x > y) - (x < y);
}

/* The aggregates the lock window leaves out: those it leaves out from
 * any version (STUCK_S above), as one bigint[] literal of keys, and those a
 * version gap holds, from the held version (the missing one, when it comes,
 * is below it), as two (keys, from which version). */
static int exclusions(struct relay *r, double now, struct buf *out, struct buf *gap_keys,
                      struct buf *gap_from) {
        size_t n = 0;
        buf_reset(out);
        buf_reset(gap_keys);
        buf_reset(gap_from);
        for (struct batch *b = r->batches; b; b = b->next)
                for (size_t i = 0; i < b->n; i++) {
                        const struct row *w = &b->rows[i];
                        if (w->stage == ROW_MARKED ||
                            (w->next < 0 && w->prev < 0 && now - b->locked_at < STUCK_S))
                                continue;
                        if (n == r->hot_cap) {
                                size_t cap = r->hot_cap ? r->hot_cap * 2 : 64;
                                long long *hot = realloc(r->hot, cap * sizeof *hot);
                                if (!hot)
                                        return -1;
                                r->hot = hot;
                                r->hot_cap = cap;
                        }
                        r->hot[n++] = w->key;
                }
        if (n > 1)
                qsort(r->hot, n, sizeof *r->hot, by_key);
        if (buf_append(out, "{", 1))
                return -1;
        for (size_t k = 0; k < n; k++)
                if ((k == 0 || r->hot[k] != r->hot[k - 1]) &&
                    buf_appendf(out, "%s%lld", out->len > 1 ? "," : "", r->hot[k]))
                        return -1;
        if (buf_append(out, "}", 1) || buf_append(gap_keys, "{", 1) || buf_append(gap_from, "{", 1))
                return -1;
        for (size_t g = 0; g < r->ngap_keys; g++)
                if (buf_appendf(gap_keys, "%s%lld", g ? "," : "", r->gap_keys[g]) ||
                    buf_appendf(gap_from, "%s%lld", g ? "," : "", r->gap_held[g]))
                        return -1;
        return buf_append(gap_keys, "}", 1) || buf_append(gap_from, "}", 1);
}

/* How many rows the next lock may take: a batch, within what the relay may
 * still hold in rows and (at the recent rows' size) in bytes, counting the
 * rows it locked and has not fetched yet at the larger of the size their
 * lock gave and the recent rows' size. */
static int lock_limit(const struct relay *r) {
        /* rows another transaction holds (and the versions behind them)
         * wait for it, not for the relay: they do not count, up to
         * HELD_ROWS_MAX batches of them, which bounds the memory they keep */
        long long held = r->rows_held_by_other;
        if (held > (long long)r->cfg->batch_size * HELD_ROWS_MAX)
                held = (long long)r->cfg->batch_size * HELD_ROWS_MAX;
        long long rows = (long long)r->cfg->batch_size * MAX_BATCHES - (r->rows_open - held);
        long long bytes = r->cfg->batch_bytes - r->bytes_held;
        for (const struct batch *b = r->batches; b && bytes > 0; b = b->next)
                for (size_t i = 0; b->unfetched && i < b->n; i++)
                        if (b->rows[i].stage == ROW_LOCKED)
                                bytes -= b->rows[i].size > r->row_bytes ? b->rows[i].size
                                                                        : (long long)r->row_bytes;
        if (rows > r->cfg->batch_size)
                rows = r->cfg->batch_size;
        if (rows > r->lock_ramp)
                rows = r->lock_ramp;
        if (r->row_bytes > 0 && bytes / r->row_bytes + 1 < rows)
                rows = (long long)(bytes / r->row_bytes) + 1;
        return rows > 0 && bytes > 0 && r->nbatches < MAX_BATCH_OBJECTS ? (int)rows : 0;
}

/* Whether the relay locks at all now: not while stopping, after a fatal
 * producer error, or while the producer's messages are purged. */
static int locking(const struct relay *r) {
        return !r->stopping && !r->fatal && !r->purged;
}

static int send_lock(struct relay *r, int limit, double now) {
        char err[512], lim[16];
        snprintf(lim, sizeof lim, "%d", limit);
        const char *params[6] = {r->cfg->relay_id,
                                 lim,
                                 NULL,
                                 NULL,
                                 r->cfg->ordering == ORDERING_INCREASING ? "increasing"
                                                                         : "aggregate",
                                 NULL};
        int n = 2;
        if (r->lock_stmt == RELAY_SQL_LOCK) {
                if (exclusions(r, now, &r->list3, &r->list, &r->list2) != 0)
                        return -1;
                params[2] = r->list.data;
                params[3] = r->list2.data;
                params[5] = r->list3.data;
                n = 6;
        }
        if (db_async_send(db_of(r, C_LOCK), r->lock_stmt, n, params, 1, now, err, sizeof err) !=
            0) {
                conn_down(r, C_LOCK, err, now);
                return -1;
        }
        r->lock_limit = limit;
        r->lock_gen = db_connects(db_of(r, C_LOCK));
        r->lock_sent_at = now;
        r->lock_wanted = 0;
        r->next_lock = now + r->cfg->poll_interval_ms / 1000.0;
        return 0;
}

/* The oldest batch with rows to fetch, or NULL. */
static struct batch *to_fetch(const struct relay *r) {
        for (struct batch *b = r->batches; b; b = b->next)
                if (b->unfetched)
                        return b;
        return NULL;
}

/* Sends the fetch of b's rows still to fetch; heads: only the first of each
 * run (see enum fetch_ask); while rows a failed fetch asked for are left,
 * one of them alone, by outbox_id. */
static int send_fetch(struct relay *r, struct batch *b, int heads, double now) {
        char err[512], bytes[24], max_row[24];
        int one = batch_suspects(b);
        long long budget = r->cfg->batch_bytes - r->bytes_held;
        if (budget > FETCH_BYTES_MAX)
                budget = FETCH_BYTES_MAX;
        if (one)
                budget = 1; /* the first row always comes */
        if (budget < 1)
                budget = 1;
        snprintf(bytes, sizeof bytes, "%lld", budget);
        snprintf(max_row, sizeof max_row, "%lld", kafka_max_message_bytes(r->kafka));
        /* $1 the ctids; or, for rows a fetch by ctid did not find and for
         * a row read alone, $5 and $6 their ctids and outbox_ids (the other
         * array parameters empty): a fetch by ctid may find another row
         * there, whose text the statement computes too */
        int by_id = b == r->moved || one;
        struct buf *empty = by_id ? &r->list : &r->list3;
        buf_reset(empty);
        buf_reset(&r->list2);
        enum fetch_ask ask = one ? ASK_ONE : heads ? ASK_HEADS : ASK_ALL;
        if (batch_fetch_list(b, ask, by_id ? &r->list3 : &r->list, by_id ? &r->list2 : NULL) ||
            buf_append(empty, "{}", 2) || (!by_id && buf_append(&r->list2, "{}", 2)))
                return -1;
        const char *params[6] = {r->list.data, r->cfg->relay_id, bytes,
                                 max_row,      r->list3.data,    r->list2.data};
        if (db_async_send(db_of(r, C_LOCK), RELAY_SQL_FETCH, 6, params, 1, now, err, sizeof err) !=
            0) {
                conn_down(r, C_LOCK, err, now);
                return -1;
        }
        r->fetching = b;
        r->fetch_alone = one;
        r->fetch_by_id = by_id;
        r->fetch_budget = budget;
        return 0;
}

/* Step: on the lock connection, fetch the content of locked rows first
 * (within the byte budget), else lock the next batch when one is due. */
static void lock_or_fetch(struct relay *r, double now) {
        if (!idle(r, C_LOCK))
                return;
        struct batch *f = to_fetch(r);
        /* Held content the producer cannot take (each row waits for a
         * version not read yet: a fetch's byte limit let later versions come
         * first) with nothing with the producer: nothing will free it. The
         * first unread version of each run is read then, over the limit
         * (the first row of a read always comes), and can go. */
        int stuck = f && r->bytes_held >= r->cfg->batch_bytes && !r->purged &&
                    kafka_outstanding(r->kafka) == 0;
        if (f && (r->bytes_held < r->cfg->batch_bytes || stuck) &&
            stmt_may_run(r, RELAY_SQL_FETCH, now)) {
                if (stuck)
                        log_debug("relay",
                                  "the rows held wait for versions not read yet: reading the "
                                  "first unread version of each run",
                                  "bytes_held=%lld", r->bytes_held);
                send_fetch(r, f, stuck, now);
                return;
        }
        if (!locking(r) || !stmt_may_run(r, r->lock_stmt, now))
                return;
        if (!(r->lock_wanted || now >= r->next_lock) || now < r->lock_not_before ||
            now < r->lock_paused_until)
                return;
        int limit = lock_limit(r);
        health_holding_full(r->health, limit == 0);
        if (limit > 0)
                send_lock(r, limit, now);
        else if (!r->holding_full)
                log_debug("relay", "not locking: holding as many rows as it may",
                          "rows_held=%lld bytes_held=%lld batches=%zu", r->rows_open, r->bytes_held,
                          r->nbatches);
        r->holding_full = limit == 0;
}

/* Learns the size of the rows' text from a fetch (its average, half-weighted
 * against the rows before): what they take in memory, which the lock's
 * estimate (their stored, maybe compressed, size) can be far below. */
static void learn_row_bytes(struct relay *r, long long bytes, long rows) {
        if (rows <= 0)
                return;
        double avg = (double)bytes / (double)rows;
        r->row_bytes = r->row_bytes > 0 ? (r->row_bytes + avg) / 2 : avg;
}

/* Logs the versions the lock statements parked since the last line: at most
 * one line per sample interval, however fast new versions of a DEAD
 * aggregate arrive. */
static void log_parked(struct relay *r, double now) {
        if (!r->parked_unlogged)
                return;
        log_warn("relay", "versions parked behind a DEAD version of their aggregate", "rows=%lld",
                 r->parked_unlogged);
        r->parked_unlogged = 0;
        r->parked_logged_at = now;
}

static void lock_result(struct relay *r, struct db_result *res, double now) {
        if (!db_result_ok(res)) {
                if (!*db_result_sqlstate(res)) {
                        /* the connection broke before the answer: the
                         * statement may have locked rows nobody has */
                        want_take_back(r);
                } else {
                        stmt_failed(r, C_LOCK, r->lock_stmt, res, now);
                }
                db_result_free(res);
                return;
        }
        stmt_ok(r, r->lock_stmt);
        health_lock_done(r->health, now);
        if (r->sample_after_lock) {
                r->sample_after_lock = 0;
                r->next_sample = now;
        }
        r->side_not_before = 0; /* the first lock is done: side work may compete with it */
        metrics_set(M_LAST_LOCK_TIMESTAMP, NULL, clock_wall_s());
        int n = db_result_rows(res);
        r->lock_ramp = r->lock_ramp > INT_MAX / LOCK_RAMP ? INT_MAX : r->lock_ramp * LOCK_RAMP;
        if (n == 0) {
                log_debug("relay", "locked", "rows=0 limit=%d rows_held=%lld", r->lock_limit,
                          r->rows_open);
                db_result_free(res);
                return;
        }
        struct batch *b = batch_new(res, (enum config_ordering)r->cfg->ordering, r->lock_gen,
                                    r->lock_sent_at);
        if (b)
                log_debug("relay", "locked", "rows=%zu deferred=%zu limit=%d rows_held=%lld", b->n,
                          (size_t)n - b->n, r->lock_limit, r->rows_open);
        if (b && b->parked) {
                r->parked_unlogged += (long long)b->parked;
                if (now - r->parked_logged_at >= SAMPLE_INTERVAL_S)
                        log_parked(r, now);
        }
        if (b && b->n == 0) {
                /* every row it returned was deferred: the window changed */
                batch_free(b);
                r->lock_wanted = 1;
                return;
        }
        if (!b) {
                log_error("relay", "out of memory for a batch: its rows go back to the sweeper",
                          "rows=%d", n);
                want_take_back(r);
                return;
        }
        if (r->last)
                r->last->next = b;
        else
                r->batches = b;
        r->last = b;
        r->nbatches++;
        r->rows_open += (long long)b->n;
        metrics_add(M_BATCHES, NULL, 1);
        lifecycle_set_rows_held((long)r->rows_open);
        b->dirty = 1;
        if (n >= r->lock_limit)
                r->lock_wanted = 1; /* a full window: more may be due at once */
        else
                r->lock_not_before = now + LOCK_AGAIN_S;
}

/* The one row a fetch asked for (read alone: a fetch with several failed)
 * failed with sqlstate ("" for a lost connection) and message why: DEAD when
 * the error says PostgreSQL cannot read it, else FAILED (an attempt: a row
 * that keeps failing so runs out of them). */
static void read_failed(struct relay *r, struct batch *b, const char *sqlstate, const char *why) {
        for (size_t i = 0; i < b->n; i++) {
                struct row *w = &b->rows[i];
                if (w->stage != ROW_LOCKED || !w->asked)
                        continue;
                int unreadable = decide_row_unreadable(sqlstate);
                const struct row *p = w->prev >= 0 ? &b->rows[w->prev] : NULL;
                if (!unreadable && p && (p->stage < ROW_SETTLED || p->mark != DECIDE_PUBLISHED)) {
                        /* the version before it was not acknowledged, so this
                         * one could not have gone yet: a failure that is not
                         * its content's gives it back, its attempt not
                         * counted, instead of spending an attempt it never had */
                        batch_settle(b, i, DECIDE_RELEASED, NULL, NULL);
                        return;
                }
                w->permanent = unreadable;
                batch_settle(
                        b, i,
                        decide_failure(unreadable, 0, w->ev.attempt_count, r->cfg->max_attempts),
                        unreadable ? "INVALID_VALUE" : "READ_FAILED", why);
                return;
        }
}

static void fetch_result(struct relay *r, struct db_result *res, double now) {
        struct batch *b = r->fetching;
        r->fetching = NULL;
        if (!db_result_ok(res)) {
                const char *state = db_result_sqlstate(res);
                int lost = db_async_phase(db_of(r, C_LOCK)) == DB_DOWN;
                if (lost)
                        fetch_lost(r, b); /* the answer was the session's end */
                /* an error of the client's with the session alive (libpq
                 * out of memory for the answer: a row too large for this
                 * process) has no SQLSTATE; as an error in the rows, they
                 * are read alone and the one that fails is found */
                if ((*state && db_fault_of(state) == DB_FAULT_STATEMENT) || (!*state && !lost)) {
                        if (!r->fetch_alone) {
                                /* something in one of its rows: each is read
                                 * alone until the one that fails is found */
                                log_warn("relay", "a fetch failed: reading its rows one at a time",
                                         "rows=%zu sqlstate=%s", batch_suspect_asked(b), state);
                        } else {
                                read_failed(r, b, state, db_result_error(res));
                        }
                } else if (*state) {
                        stmt_failed(r, C_LOCK, RELAY_SQL_FETCH, res, now);
                }
                db_result_free(res);
                return;
        }
        stmt_ok(r, RELAY_SQL_FETCH);
        long long bytes = 0, answered = 0;
        long filled =
                batch_take_fetch(b, res, kafka_max_message_bytes(r->kafka), &bytes, &answered);
        if (filled < 0) {
                log_error("relay", "out of memory for fetched rows", NULL);
                return;
        }
        r->bytes_held += bytes;
        learn_row_bytes(r, bytes, filled);
        /* Below the byte limit the answer left no row out: a row asked for
         * and not in it is not where, or not whose, its lock said. */
        size_t missing = 0;
        for (size_t i = 0; i < b->n; i++)
                missing += b->rows[i].stage == ROW_LOCKED && b->rows[i].asked;
        if (answered < r->fetch_budget && missing > 0) {
                if (!r->fetch_by_id) {
                        /* a fetch by ctid (send_fetch()): moved by an UPDATE
                         * since their lock, or taken back */
                        log_info("relay",
                                 "rows not found where their lock left them: reading "
                                 "them by outbox_id",
                                 "rows=%zu", missing);
                        r->moved = b;
                } else {
                        /* not this relay's any more (taken back by the
                         * sweeper, or deleted): nothing to send or mark */
                        for (size_t i = 0; i < b->n; i++)
                                if (b->rows[i].stage == ROW_LOCKED && b->rows[i].asked) {
                                        batch_settle(b, i, DECIDE_RELEASED, NULL, NULL);
                                        row_done(r, &b->rows[i], 1);
                                }
                        log_lost(r, "locks lost before sending");
                }
        }
}

/* ---- marking (the mark connection) -------------------------------------- */

/* The statement that marks outcome `m`. */
static int mark_stmt(enum decide_mark m) {
        return m == DECIDE_PUBLISHED  ? RELAY_SQL_MARK_PUBLISHED
               : m == DECIDE_RELEASED ? RELAY_SQL_MARK_RELEASED
                                      : RELAY_SQL_MARK_UNPUBLISHED;
}

/* Adds row w to the rows of the statement being built on the mark
 * connection, and its outbox_id to its list (mp[1]); -1 out of memory. */
static int marking_add(struct relay *r, struct row *w) {
        if (r->nmarking == r->marking_cap) {
                size_t cap = r->marking_cap ? r->marking_cap * 2 : 256;
                struct row **m = realloc(r->marking, cap * sizeof *m);
                if (!m)
                        return -1;
                r->marking = m;
                r->marking_cap = cap;
        }
        r->marking[r->nmarking++] = w;
        return array_add(&r->mp[1], w->id);
}

/* Adds row w to the mark statement being built; -1 out of memory. */
static int mark_add(struct relay *r, struct row *w) {
        if (marking_add(r, w) || array_add(&r->mp[0], w->tid))
                return -1;
        if (w->mark != DECIDE_FAILED && w->mark != DECIDE_DEAD)
                return 0;
        char delay[24];
        const char *msg = w->message;
        char counted[sizeof w->message];
        if (w->mark == DECIDE_DEAD && !w->permanent && !w->ev.late) {
                /* out of attempts: the message says so */
                snprintf(counted, sizeof counted, "%.100s (attempt %d of %d)", w->message,
                         w->ev.attempt_count, r->cfg->max_attempts);
                encode_utf8_clean(counted);
                msg = counted;
        }
        if (w->mark == DECIDE_FAILED)
                w->delay_ms = decide_backoff_ms(w->ev.attempt_count, r->cfg->backoff_initial_ms,
                                                r->cfg->backoff_max_ms, (unsigned)rand_r(&r->seed));
        snprintf(delay, sizeof delay, "%lld", w->delay_ms);
        return array_add(&r->mp[2], delay) || array_add(&r->mp[3], w->code) ||
               array_add(&r->mp[4], msg) || array_add(&r->mp[5], w->uncounted ? "1" : "0");
}

/* Counts an outcome into the metrics and the log as it is marked. */
static void count_outcome(const struct row *w) {
        if (w->mark == DECIDE_DEAD) {
                metrics_add(M_EVENTS_DEAD, w->code, 1);
                log_warn("relay", "event dead", "outbox_id=%s topic=%s err=%s reason=%s", w->id,
                         w->topic ? w->topic : "-", w->code, w->message);
        } else if (w->mark == DECIDE_FAILED) {
                metrics_add(M_EVENTS_FAILED, w->code, 1);
        }
}

/* Whether settled row w stays out of the marks: another transaction holds
 * it, or it would go PUBLISHED before an earlier version of its run that is
 * held (that version would then read as late: DESIGN.md, LATE_VERSION). */
static int left_out(const struct row *w) {
        return w->held_by_other || (w->behind_held && w->mark == DECIDE_PUBLISHED);
}

/* Sends stmt on the mark connection for the rows in r->marking: the relay
 * id and their outbox_ids (mp[1]). -1 when the connection is lost. */
static int send_ids(struct relay *r, int stmt, double now) {
        char err[512];
        const char *params[2] = {r->cfg->relay_id, r->mp[1].data};
        r->marking_stmt = stmt; /* what conn_down() makes of the rows */
        if (db_async_send(db_of(r, C_MARK), stmt, 2, params, 1, now, err, sizeof err) != 0) {
                conn_down(r, C_MARK, err, now);
                return -1;
        }
        return 0;
}

/* Asks which of the rows whose mark gave up on a lock, and are due to be
 * asked about, another transaction still holds (mark_probe.sql). */
static void send_probe(struct relay *r, double now) {
        buf_reset(&r->mp[1]);
        if (buf_append(&r->mp[1], "{", 1))
                return;
        r->nmarking = 0;
        for (struct batch *b = r->batches; b; b = b->next)
                for (size_t i = 0; i < b->n; i++) {
                        struct row *w = &b->rows[i];
                        if (w->stage == ROW_SETTLED && w->held_by_other && w->probe_at <= now &&
                            marking_add(r, w) != 0)
                                goto unsent; /* out of memory */
                }
        if (buf_append(&r->mp[1], "}", 1) || send_ids(r, RELAY_SQL_MARK_PROBE, now) != 0)
                goto unsent;
        for (size_t i = 0; i < r->nmarking; i++)
                r->marking[i]->stage = ROW_MARKING;
        return;
unsent:
        r->nmarking = 0; /* nothing sent: no row is in a statement */
}

/* Step: when the mark connection is free, marks the settled rows of one
 * outcome class (the class of the oldest settled row), all of them in one
 * statement, once they waited MARK_LINGER_S (at once when stopping). Rows
 * another transaction holds are left out, so that they hold back only
 * themselves (and their aggregates), and are asked about until free. */
static void mark(struct relay *r, double now) {
        char err[512];
        struct row *oldest = NULL;
        size_t settled = 0;
        double oldest_any = 0;
        int probe_due = 0;
        r->next_probe = 0;
        r->rows_held_by_other = 0;
        r->rows_locked = 0;
        for (struct batch *b = r->batches; b; b = b->next)
                for (size_t i = 0; i < b->n; i++) {
                        struct row *w = &b->rows[i];
                        /* a later version of a held row waits for its mark:
                         * PUBLISHED never goes to a version before its
                         * predecessor (a row in a run follows its
                         * predecessor in the batch) */
                        if (r->nheld > 0) {
                                const struct row *p = w->prev >= 0 ? &b->rows[w->prev] : NULL;
                                w->behind_held = p && p->stage != ROW_MARKED &&
                                                 (p->held_by_other || p->behind_held);
                        } else if (w->behind_held) {
                                w->behind_held = 0; /* nothing held: no write per row */
                        }
                        int waits = w->stage == ROW_SETTLED ||
                                    (w->stage == ROW_MARKING && w->held_by_other);
                        if (!waits)
                                continue;
                        if (oldest_any == 0 || w->settled_at < oldest_any)
                                oldest_any = w->settled_at;
                        if (left_out(w))
                                r->rows_held_by_other++;
                        r->rows_locked += w->row_locked;
                        if (w->stage != ROW_SETTLED || (left_out(w) && !w->held_by_other))
                                continue;
                        if (w->held_by_other) {
                                probe_due |= w->probe_at <= now;
                                if (r->next_probe == 0 || w->probe_at < r->next_probe)
                                        r->next_probe = w->probe_at;
                                continue;
                        }
                        settled++;
                        if (!oldest || w->settled_at < oldest->settled_at)
                                oldest = w;
                }
        /* readiness counts every outcome that waits, held ones too: they
         * are stuck; the linger only the rows a mark may take */
        r->oldest_settled = oldest_any;
        r->oldest_free = oldest ? oldest->settled_at : 0;
        health_mark_waiting(r->health, r->oldest_settled);
        if (!idle(r, C_MARK))
                return;
        if (probe_due && stmt_may_run(r, RELAY_SQL_MARK_PROBE, now)) {
                send_probe(r, now);
                return;
        }
        if (!oldest)
                return;
        int stmt = mark_stmt(oldest->mark);
        if (!stmt_may_run(r, stmt, now))
                return;
        if (!r->stopping && settled < (size_t)r->cfg->batch_size / 2 &&
            now - oldest->settled_at < MARK_LINGER_S)
                return;
        for (int k = 0; k < 6; k++) {
                buf_reset(&r->mp[k]);
                if (buf_append(&r->mp[k], "{", 1))
                        return;
        }
        r->nmarking = 0;
        for (struct batch *b = r->batches; b; b = b->next)
                for (size_t i = 0; i < b->n; i++) {
                        struct row *w = &b->rows[i];
                        if (w->stage != ROW_SETTLED || left_out(w) || mark_stmt(w->mark) != stmt)
                                continue;
                        if (stmt == RELAY_SQL_MARK_UNPUBLISHED && w->mark != oldest->mark)
                                continue; /* FAILED and DEAD go in statements of their own */
                        if (mark_add(r, w) != 0)
                                goto unsent; /* out of memory */
                }
        for (int k = 0; k < 6; k++)
                if (buf_append(&r->mp[k], "}", 1))
                        goto unsent;
        const char *params[8];
        int n;
        /* PUBLISHED by ctid and outbox_id (the rows an UPDATE moved are
         * looked for by outbox_id next); the rare other outcomes by
         * outbox_id alone */
        params[0] = r->cfg->relay_id;
        if (stmt == RELAY_SQL_MARK_UNPUBLISHED) {
                params[1] = oldest->mark == DECIDE_FAILED ? "FAILED" : "DEAD";
                for (int k = 1; k < 6; k++)
                        params[1 + k] = r->mp[k].data;
                n = 7;
        } else if (stmt == RELAY_SQL_MARK_RELEASED) {
                params[1] = r->mp[1].data;
                n = 2;
        } else {
                params[1] = r->mp[0].data;
                params[2] = r->mp[1].data;
                n = 3;
        }
        if (db_async_send(db_of(r, C_MARK), stmt, n, params, 1, now, err, sizeof err) != 0) {
                r->nmarking = 0;
                conn_down(r, C_MARK, err, now);
                return;
        }
        r->marking_stmt = stmt;
        for (size_t i = 0; i < r->nmarking; i++)
                r->marking[i]->stage = ROW_MARKING;
        return;
unsent:
        r->nmarking = 0; /* nothing sent: no row is in a statement */
}

static int by_uuid(const void *a, const void *b) {
        return memcmp(a, b, 16);
}

/* Sends mark_published_by_id for the rows of the mark just answered that
 * it did not find by ctid (an update moved them since their lock). */
static void mark_moved(struct relay *r, double now) {
        int bad = 0;
        buf_reset(&r->mp[1]);
        bad = buf_append(&r->mp[1], "{", 1);
        for (size_t i = 0; !bad && i < r->nmarking; i++)
                bad = array_add(&r->mp[1], r->marking[i]->id);
        if (!bad && !buf_append(&r->mp[1], "}", 1)) {
                (void)send_ids(r, RELAY_SQL_MARK_PUBLISHED_BY_ID, now);
                return;
        }
        marking_unknown(r); /* out of memory */
}

/* A row is marked (or its lock was lost): it leaves the relay. */
static void row_done(struct relay *r, struct row *w, int lost) {
        if (lost && w->mark == DECIDE_FAILED)
                /* the attempt failed whether or not its mark still applied:
                 * outbox_events_failed_total counts attempts, so a broker
                 * down past the lock timeout still shows in the failure rate */
                metrics_add(M_EVENTS_FAILED, w->code, 1);
        if (lost && !w->mark_uncertain) {
                metrics_add(M_LOCK_LOST, NULL, 1);
                if (r->lost_n++ == 0)
                        snprintf(r->lost_first, sizeof r->lost_first, "%s", w->id);
        } else if (!lost) {
                count_outcome(w);
        }
        if (w->held_by_other) {
                w->held_by_other = 0;
                r->nheld--;
        }
        w->row_locked = 0;
        w->stage = ROW_MARKED;
        w->batch->open--;
        r->rows_open--;
}

/* One line (msg) for the rows of one answer whose lock was lost (taken
 * back, or changed by another session): however many a DBA's statement
 * touched. */
static void log_lost(struct relay *r, const char *msg) {
        if (r->lost_n)
                log_warn("relay", msg, "rows=%zu outbox_id=%s", r->lost_n, r->lost_first);
        r->lost_n = 0;
}

/* A row of mark_probe's answer (its outbox_id first: by_uuid sorts it). */
struct probed {
        unsigned char id[16];
        int free;
};

/* mark_probe's answer: the rows no other transaction holds go back to the
 * marks; the held ones are asked about again in PROBE_REPEAT_S; a row the
 * answer leaves out is no longer this relay's. */
static void probe_result(struct relay *r, struct db_result *res, double now) {
        stmt_ok(r, RELAY_SQL_MARK_PROBE);
        int n = db_result_rows(res);
        struct probed *got = calloc(n ? (size_t)n : 1, sizeof *got);
        if (!got) {
                for (size_t i = 0; i < r->nmarking; i++) {
                        r->marking[i]->stage = ROW_SETTLED;
                        r->marking[i]->probe_at = now + PROBE_REPEAT_S;
                }
                r->nmarking = 0;
                db_result_free(res);
                return;
        }
        for (int k = 0; k < n; k++) {
                if (db_result_length(res, k, 0) == 16)
                        memcpy(got[k].id, db_result_value(res, k, 0), 16);
                got[k].free = db_result_length(res, k, 1) == 1 && db_result_value(res, k, 1)[0];
        }
        qsort(got, (size_t)n, sizeof *got, by_uuid);
        db_result_free(res);
        size_t held = 0, gone = 0;
        const char *first = NULL;
        for (size_t i = 0; i < r->nmarking; i++) {
                struct row *w = r->marking[i];
                struct probed *g = bsearch(w->id_bin, got, (size_t)n, sizeof *got, by_uuid);
                if (!g) {
                        row_done(r, w, 1);
                        gone++;
                        continue;
                }
                w->stage = ROW_SETTLED;
                w->row_locked = !g->free;
                if (g->free) {
                        w->held_by_other = 0;
                        r->nheld--;
                        continue;
                }
                if (!first)
                        first = w->id;
                held++;
                w->probe_at = now + PROBE_REPEAT_S;
        }
        free(got);
        log_lost(r, "locks lost before marking");
        long long total = r->nheld;
        if (held && (!r->held_said || total >= 2 * r->held_logged ||
                     now - r->held_logged_at >= BLOCKED_REPEAT_S)) {
                r->held_logged_at = now;
                r->held_logged = total;
                r->held_said = 1;
                log_warn("relay", "events held by another transaction: marking the others",
                         "rows=%lld outbox_id=%s", total, first);
        } else if (held) {
                log_debug("relay", "events held by another transaction", "rows=%lld outbox_id=%s",
                          total, first);
        }
        /* once no row is held any more, after a line said some were */
        if (r->held_said && r->nheld == 0) {
                r->held_said = 0;
                log_info("relay", "no event held by another transaction any more", NULL);
        }
        r->nmarking = 0;
        if (gone)
                r->lock_wanted = 1; /* versions behind a lost one may go */
}

static void mark_result(struct relay *r, struct db_result *res, double now) {
        int stmt = r->marking_stmt;
        if (!db_result_ok(res) && !*db_result_sqlstate(res)) {
                /* no answer from the server (the connection was lost
                 * while the statement ran): it may have committed */
                marking_unknown(r);
                db_result_free(res);
                return;
        }
        if (!db_result_ok(res)) {
                const char *state = db_result_sqlstate(res);
                /* a lock waited for past lock_timeout: a row lock of
                 * another transaction on one of these rows (or a table
                 * lock): mark_probe asks which, and the others go on */
                int held = !strcmp(state, "55P03");
                stmt_failed(r, C_MARK, stmt, res, now);
                for (size_t i = 0; i < r->nmarking; i++) {
                        struct row *w = r->marking[i];
                        w->stage = ROW_SETTLED; /* marked again later */
                        if (held && !w->held_by_other) {
                                w->held_by_other = 1;
                                r->nheld++;
                                w->probe_at = now;
                        } else if (held) {
                                w->probe_at = r->stmts[stmt].retry_at;
                        }
                }
                r->nmarking = 0;
                db_result_free(res);
                return;
        }
        if (stmt == RELAY_SQL_MARK_PROBE) {
                probe_result(r, res, now);
                return;
        }
        stmt_ok(r, stmt);
        health_mark_done(r->health, now);
        metrics_set(M_LAST_MARK_TIMESTAMP, NULL, clock_wall_s());
        /* the rows it marked: their outbox_ids (binary uuids), sorted */
        int n = db_result_rows(res);
        unsigned char(*ids)[16] = calloc(n ? (size_t)n : 1, sizeof *ids);
        if (!ids) {
                db_result_free(res);
                marking_unknown(r);
                return;
        }
        for (int k = 0; k < n; k++)
                if (db_result_length(res, k, 0) == 16)
                        memcpy(ids[k], db_result_value(res, k, 0), 16);
        qsort(ids, (size_t)n, sizeof *ids, by_uuid);
        db_result_free(res);
        size_t missing = 0;
        for (size_t i = 0; i < r->nmarking; i++) {
                struct row *w = r->marking[i];
                if (bsearch(w->id_bin, ids, (size_t)n, sizeof *ids, by_uuid)) {
                        row_done(r, w, 0);
                } else if (stmt == RELAY_SQL_MARK_PUBLISHED) {
                        r->marking[missing++] = w; /* looked for by id next */
                } else {
                        row_done(r, w, 1);
                }
        }
        free(ids);
        log_lost(r, "locks lost before marking");
        if (stmt == RELAY_SQL_MARK_UNPUBLISHED && r->nmarking &&
            r->marking[0]->mark == DECIDE_FAILED)
                log_warn("relay", "events failed, will retry", "failed=%zu err=%s retry_ms=%lld",
                         r->nmarking, r->marking[0]->code, r->marking[0]->delay_ms);
        r->nmarking = missing;
        if (missing)
                mark_moved(r, now);
        r->lock_wanted = 1; /* marked versions may let their successors go */
}

/* ---- the side connection ------------------------------------------------ */

/* Hash of a gap's aggregate and held version, to log each gap once. */
static unsigned long long gap_hash(const struct db_result *res, int k) {
        unsigned long long h = 1469598103934665603ULL;
        for (int c = 0; c < 4; c++) {
                const char *p = db_result_value(res, k, c);
                int len = db_result_length(res, k, c);
                for (int i = 0; i < len; i++)
                        h = (h ^ (unsigned char)p[i]) * 1099511628211ULL;
                h = (h ^ 0xff) * 1099511628211ULL;
        }
        return h;
}

static int gap_is_new(struct relay *r, unsigned long long h) {
        for (size_t i = 0; i < r->ngaps_seen; i++)
                if (r->gaps_seen[i] == h)
                        return 0;
        if (r->ngaps_seen == GAP_SEEN_MAX)
                r->ngaps_seen = 0;
        r->gaps_seen[r->ngaps_seen++] = h;
        return 1;
}

static void side_send(struct relay *r, enum side_task task, int stmt, int n,
                      const char *const *params, double now) {
        char err[512];
        if (db_async_send(db_of(r, C_SIDE), stmt, n, params, 1, now, err, sizeof err) != 0) {
                conn_down(r, C_SIDE, err, now);
                return;
        }
        r->side_task = task;
}

/* The oldest open batch's lock connection generation (the current one when
 * none): rows locked on older connections are still being worked on. */
static long oldest_gen(const struct relay *r) {
        long gen = db_connects(r->conns[C_LOCK].db);
        for (const struct batch *b = r->batches; b; b = b->next)
                if (b->lock_gen < gen)
                        gen = b->lock_gen;
        return gen;
}

/* How long a statement waits before its blockers are looked up: within
 * the lock timeout, or the server cancels the wait first. */
static double blocked_report_s(const struct relay *r) {
        double half = r->cfg->db_lock_timeout_ms / 2000.0;
        return half < BLOCKED_REPORT_S ? half : BLOCKED_REPORT_S;
}

/* Step: the side connection's work, one statement at a time: take back what
 * this relay id holds that no batch has; tell who blocks a statement that
 * waits; check the table's indexes (at start, and when a lock statement
 * starts to time out); sample the table (then its gaps, what they hold, the
 * horizon). */
static void side_work(struct relay *r, double now) {
        if (!idle(r, C_SIDE) || now < r->side_not_before)
                return;
        struct db *lockdb = db_of(r, C_LOCK);
        if (r->take_back_wanted && db_async_phase(lockdb) >= DB_IDLE &&
            oldest_gen(r) == db_connects(lockdb) && stmt_may_run(r, RELAY_SQL_TAKE_BACK_OWN, now)) {
                char attempts[16], limit[16];
                snprintf(attempts, sizeof attempts, "%d", r->cfg->max_attempts);
                snprintf(limit, sizeof limit, "%d", TAKE_BACK_LIMIT);
                const char *params[4] = {r->cfg->relay_id, db_async_connected_at(lockdb), attempts,
                                         limit};
                r->take_back_sent = r->take_back_asks;
                side_send(r, SIDE_TAKE_BACK, RELAY_SQL_TAKE_BACK_OWN, 4, params, now);
                return;
        }
        for (int c = C_LOCK; c <= C_MARK; c++) {
                double since;
                const char *running = db_async_running(db_of(r, c), &since);
                if (running && now - since > blocked_report_s(r) && r->blockers_for[c] != since &&
                    (!r->blockers_at[c] || now - r->blockers_at[c] >= BLOCKED_REPEAT_S)) {
                        char pid[16];
                        snprintf(pid, sizeof pid, "%d", db_backend_pid(db_of(r, c)));
                        const char *params[1] = {pid};
                        r->blockers_for[c] = since;
                        r->blockers_at[c] = now;
                        r->blockers_conn = c;
                        side_send(r, SIDE_BLOCKERS, RELAY_SQL_BLOCKERS, 1, params, now);
                        return;
                }
        }
        if (r->indexes_done != r->indexes_asks && !r->stopping &&
            stmt_may_run(r, RELAY_SQL_INDEXES, now)) {
                /* the indexes its statements read: the lock's window, and
                 * the order guard's unless the ordering is none; and the
                 * old guard index, which older relays read */
                const char *params[1] = {r->cfg->ordering == ORDERING_NONE
                                                 ? "{due,old}"
                                                 : "{due,unpublished,published,old}"};
                r->indexes_sent = r->indexes_asks;
                side_send(r, SIDE_INDEXES, RELAY_SQL_INDEXES, 1, params, now);
                return;
        }
        if (now >= r->next_sample && !r->stopping && stmt_may_run(r, RELAY_SQL_SAMPLE, now)) {
                r->sample_started = now;
                side_send(r, SIDE_SAMPLE, RELAY_SQL_SAMPLE, 0, NULL, now);
        }
}

/* After a sample: the next step of the sampling chain, or none. */
static void sample_next(struct relay *r, enum side_task done, double now) {
        char age[16], max[16];
        if (done == SIDE_SAMPLE && r->cfg->ordering == ORDERING_AGGREGATE &&
            stmt_may_run(r, RELAY_SQL_GAPS, now)) {
                snprintf(age, sizeof age, "%d", GAP_REPORT_AFTER_S);
                snprintf(max, sizeof max, "%d", GAP_LOG_MAX);
                const char *params[2] = {age, max};
                side_send(r, SIDE_GAPS, RELAY_SQL_GAPS, 2, params, now);
                return;
        }
        if (done == SIDE_SAMPLE || done == SIDE_GAPS) {
                struct buf *keys = &r->list;
                buf_reset(keys);
                int bad = buf_append(keys, "{", 1);
                for (size_t i = 0; i < r->ngap_keys && !bad; i++)
                        bad = buf_appendf(keys, "%s%lld", i ? "," : "", r->gap_keys[i]);
                if (!bad && !buf_append(keys, "}", 1)) {
                        const char *params[1] = {keys->data};
                        side_send(r, SIDE_HELD, RELAY_SQL_HELD, 1, params, now);
                        return;
                }
        }
        if ((done == SIDE_HELD || done == SIDE_GAPS) && r->cfg->ordering != ORDERING_NONE) {
                side_send(r, SIDE_HORIZON, RELAY_SQL_HORIZON, 0, NULL, now);
                return;
        }
        /* versions parked behind a DEAD one whose DEAD version is gone go
         * again without waiting for a sweep (the lock parks, so the relay
         * does not leave unparking to a sweeper that may not run) */
        if (done == SIDE_HORIZON && r->parked_seen > 0 && stmt_may_run(r, RELAY_SQL_UNPARK, now)) {
                snprintf(max, sizeof max, "%d", UNPARK_LIMIT);
                const char *params[2] = {max, "0"}; /* only what no DEAD version holds */
                side_send(r, SIDE_UNPARK, RELAY_SQL_UNPARK, 2, params, now);
                return;
        }
        /* the chain is done: time the next sample by how long this one took */
        double took = now - r->sample_started;
        int slow = took * SAMPLE_SPACING > SAMPLE_INTERVAL_S;
        double spacing = took * SAMPLE_SPACING;
        if (spacing > took + SAMPLE_WAIT_MAX_S)
                spacing = took + SAMPLE_WAIT_MAX_S;
        r->next_sample = r->sample_started + (slow ? spacing : SAMPLE_INTERVAL_S);
        if (slow != r->sample_slow)
                log_info("relay",
                         slow ? "table sample slow, sampling less often"
                              : "table sample fast again, sampling at the usual interval",
                         "seconds=%.3f next_in_s=%.1f", took, r->next_sample - now);
        r->sample_slow = slow;
}

static double value_f(const struct db_result *res, int row, int col) {
        /* float8 in the binary format: the IEEE 754 bits, big-endian */
        long long bits = db_int(db_result_value(res, row, col), 8);
        double d;
        memcpy(&d, &bits, sizeof d);
        return d;
}

static void sampled(struct relay *r, const struct db_result *res) {
        static const char *const status[5] = {"PENDING", "PUBLISHING", "PUBLISHED", "FAILED",
                                              "DEAD"};
        if (db_result_rows(res) != 1)
                return;
        for (int i = 0; i < 5; i++)
                metrics_set(M_EVENTS, status[i], value_f(res, 0, i));
        metrics_set(M_OLDEST_PENDING_AGE, NULL, value_f(res, 0, 5));
        metrics_set(M_HELD_AGGREGATES, "dead", value_f(res, 0, 7));
        r->parked_seen = value_f(res, 0, 6);
        r->ngap_keys = 0;
}

static void gaps_found(struct relay *r, const struct db_result *res) {
        int n = db_result_rows(res);
        long long total = n ? db_int(db_result_value(res, 0, 7), 8) : 0;
        metrics_set(M_VERSION_GAPS, NULL, (double)total);
        metrics_set(M_HELD_AGGREGATES, "gap", (double)total);
        metrics_set(M_VERSION_GAP_AGE, NULL, n ? value_f(res, 0, 5) : 0);
        r->ngap_keys = 0;
        for (int k = 0; k < n && r->ngap_keys < GAP_LOG_MAX; k++) {
                r->gap_keys[r->ngap_keys] = db_int(db_result_value(res, k, 6), 8);
                r->gap_held[r->ngap_keys++] = db_int(db_result_value(res, k, 3), 8);
                if (!gap_is_new(r, gap_hash(res, k)))
                        continue;
                long long held = db_int(db_result_value(res, k, 3), 8);
                long long prev = db_int(db_result_value(res, k, 4), 8);
                log_warn("relay", "version gap holds an aggregate",
                         "tenant_id=%s aggregate_type=%s aggregate_id=%s held_version=%lld "
                         "missing_from=%lld missing_to=%lld age_s=%.0f",
                         db_result_value(res, k, 0), db_result_value(res, k, 1),
                         db_result_value(res, k, 2), held, prev + 1, held - 1, value_f(res, k, 5));
        }
}

static void horizon_seen(struct relay *r, const struct db_result *res) {
        int holds = db_result_rows(res) == 1 && db_result_length(res, 0, 5) == 1 &&
                    db_result_value(res, 0, 5)[0];
        double age = holds ? value_f(res, 0, 4) : 0;
        if (!holds || age < HORIZON_REPORT_S) {
                int same = db_result_rows(res) == 1 && !db_result_isnull(res, 0, 0) &&
                           (int)db_int(db_result_value(res, 0, 0), 4) == r->horizon_pid;
                if (r->horizon_pid)
                        log_info("relay",
                                 same ? "the long transaction no longer holds rows back"
                                      : "the long transaction ended",
                                 "pid=%d", r->horizon_pid);
                r->horizon_pid = 0;
                metrics_set(M_OLDEST_TRANSACTION_AGE, NULL, 0);
                return;
        }
        int pid = db_result_isnull(res, 0, 0) ? -1 : (int)db_int(db_result_value(res, 0, 0), 4);
        metrics_set(M_OLDEST_TRANSACTION_AGE, NULL, age);
        if (pid == r->horizon_pid)
                return;
        r->horizon_pid = pid;
        log_warn("relay", "a long transaction holds rows back",
                 "pid=%d age_s=%.0f database=%s application_name=%s state=%s", pid, age,
                 db_result_isnull(res, 0, 1) ? "-" : db_result_value(res, 0, 1),
                 db_result_isnull(res, 0, 2) ? "-" : db_result_value(res, 0, 2),
                 db_result_isnull(res, 0, 3) ? "-" : db_result_value(res, 0, 3));
}

static void blockers_seen(struct relay *r, const struct db_result *res) {
        double since;
        const char *running = db_async_running(db_of(r, r->blockers_conn), &since);
        for (int k = 0; k < db_result_rows(res); k++)
                log_warn("db", "a statement waits for another session",
                         "connection=%s statement=%s waiting_s=%.1f blocker_pid=%lld "
                         "blocker_database=%s blocker_application=%s blocker_state=%s "
                         "blocker_wait=%s blocker_xact_age_s=%.0f blocker_command=%s",
                         conn_names[r->blockers_conn], running ? running : "-",
                         running ? clock_mono_s() - since : 0.0,
                         db_int(db_result_value(res, k, 0), 4), db_result_value(res, k, 1),
                         db_result_value(res, k, 2), db_result_value(res, k, 3),
                         db_result_value(res, k, 4), value_f(res, k, 5),
                         db_result_value(res, k, 6));
}

/* After the index check: one line per finding. */
static void indexes_seen(struct relay *r, const struct db_result *res) {
        r->indexes_done = r->indexes_sent;
        indexes_log("relay", res);
}

/* Whether `task` is a step of the sampling chain (sample_next() sends the next). */
static int in_sample_chain(enum side_task task) {
        return task == SIDE_SAMPLE || task == SIDE_GAPS || task == SIDE_HELD ||
               task == SIDE_HORIZON || task == SIDE_UNPARK;
}

static void side_result(struct relay *r, struct db_result *res, double now) {
        enum side_task task = r->side_task;
        static const int stmt_of[] = {[SIDE_TAKE_BACK] = RELAY_SQL_TAKE_BACK_OWN,
                                      [SIDE_SAMPLE] = RELAY_SQL_SAMPLE,
                                      [SIDE_GAPS] = RELAY_SQL_GAPS,
                                      [SIDE_HELD] = RELAY_SQL_HELD,
                                      [SIDE_HORIZON] = RELAY_SQL_HORIZON,
                                      [SIDE_UNPARK] = RELAY_SQL_UNPARK,
                                      [SIDE_BLOCKERS] = RELAY_SQL_BLOCKERS,
                                      [SIDE_INDEXES] = RELAY_SQL_INDEXES};
        r->side_task = SIDE_IDLE;
        if (task == SIDE_IDLE) {
                db_result_free(res);
                return;
        }
        int stmt = stmt_of[task];
        if (!db_result_ok(res)) {
                if (*db_result_sqlstate(res))
                        stmt_failed(r, C_SIDE, stmt, res, now);
                /* the index check only informs: an error (logged above) is
                 * not tried again until a lock statement starts to time out,
                 * and never makes the relay not ready */
                if (task == SIDE_INDEXES && *db_result_sqlstate(res))
                        r->indexes_done = r->indexes_sent;
                /* a read of the chain that gave up on the table's lock
                 * starts again as soon as a lock statement works (the
                 * readiness it holds clears with the lock's end), not on
                 * a short timer: meanwhile the side connection stays free
                 * to name the blockers of the others. unpark waits for
                 * rows, which a lock statement says nothing about. */
                if (in_sample_chain(task)) {
                        r->next_sample = now + SAMPLE_INTERVAL_S;
                        r->sample_after_lock =
                                task != SIDE_UNPARK && !strcmp(db_result_sqlstate(res), "55P03");
                }
                db_result_free(res);
                return;
        }
        stmt_ok(r, stmt);
        switch (task) {
        case SIDE_TAKE_BACK: {
                long long n = db_result_rows(res) ? db_int(db_result_value(res, 0, 0), 8) : 0;
                long long dead = db_result_rows(res) ? db_int(db_result_value(res, 0, 1), 8) : 0;
                if (n)
                        log_warn("relay", "took back rows locked under this relay id",
                                 "rows=%lld dead=%lld", n, dead);
                r->take_back_wanted =
                        n >= TAKE_BACK_LIMIT || r->take_back_asks != r->take_back_sent;
                if (n)
                        r->lock_wanted = 1;
                break;
        }
        case SIDE_SAMPLE:
                sampled(r, res);
                log_parked(r, now);
                break;
        case SIDE_GAPS: gaps_found(r, res); break;
        case SIDE_HELD:
                if (db_result_rows(res) == 1) {
                        metrics_set(M_OLDEST_DUE_AGE, NULL, value_f(res, 0, 0));
                        metrics_set(M_EVENTS_HELD, NULL, value_f(res, 0, 1));
                }
                break;
        case SIDE_HORIZON: horizon_seen(r, res); break;
        case SIDE_UNPARK: {
                long long n = db_result_rows(res) ? db_int(db_result_value(res, 0, 0), 8) : 0;
                if (n) {
                        log_info("relay", "parked versions due again", "rows=%lld", n);
                        r->lock_wanted = 1;
                }
                break;
        }
        case SIDE_BLOCKERS: blockers_seen(r, res); break;
        case SIDE_INDEXES: indexes_seen(r, res); break;
        default: break;
        }
        db_result_free(res);
        if (in_sample_chain(task))
                sample_next(r, task, now);
}

/* ---- batches, health, stopping, waiting --------------------------------- */

/* Step: frees the batches whose every row is marked. */
static void free_done(struct relay *r, double now) {
        struct batch **pp = &r->batches, *prev = NULL;
        while (*pp) {
                struct batch *b = *pp;
                if (b->open > 0 || r->fetching == b) {
                        prev = b;
                        pp = &b->next;
                        continue;
                }
                *pp = b->next;
                if (r->last == b)
                        r->last = prev;
                if (r->moved == b)
                        r->moved = NULL;
                r->nbatches--;
                metrics_observe(M_BATCH_DURATION, now - b->locked_at);
                log_debug("relay", "batch done", "rows=%zu seconds=%.3f", b->n, now - b->locked_at);
                batch_free(b);
        }
        long long bytes = 0;
        for (struct batch *b = r->batches; b; b = b->next)
                bytes += batch_bytes(b);
        r->bytes_held = bytes;
        lifecycle_set_rows_held((long)r->rows_open);
}

/* Step: the readiness conditions the loop knows. */
static void report_health(struct relay *r, double now) {
        int up = 1;
        const char *why = NULL; /* none: a first connect, or a new session opening */
        const char *missing = NULL;
        for (int c = 0; c < C_COUNT; c++) {
                if (db_async_phase(r->conns[c].db) >= DB_IDLE)
                        continue;
                up = 0;
                if (r->conns[c].why[0])
                        why = r->conns[c].why;
                if (db_async_table_missing(r->conns[c].db))
                        missing = r->conns[c].why;
        }
        if (up || missing)
                health_set(r->health, H_DATABASE, 1, "connected");
        else
                health_set(r->health, H_DATABASE, 0, "connecting%s%s", why ? ": " : "",
                           why ? why : "");
        if (missing)
                health_set(r->health, H_TABLE, 0, "%s", missing);
        else if (up)
                health_set(r->health, H_TABLE, 1, "%s", db_table_name(r->conns[C_LOCK].db));
        health_set(r->health, H_KAFKA, kafka_broker_up(r->kafka), "%s",
                   kafka_broker_up(r->kafka) ? "a broker is reachable" : "no broker reachable");
        int worst = -1; /* the index check only informs: never a cause */
        for (int s = 0; s < RELAY_SQL_COUNT; s++)
                if (s != RELAY_SQL_INDEXES && r->stmts[s].failures >= 2 &&
                    (worst < 0 || r->stmts[s].failures > r->stmts[worst].failures))
                        worst = s;
        if (worst >= 0)
                health_set(r->health, H_STATEMENTS, 0, "%s failing: %s %s (%d times)",
                           relay_sql[worst].name, r->stmts[worst].sqlstate, r->stmts[worst].error,
                           r->stmts[worst].failures);
        else
                health_set(r->health, H_STATEMENTS, 1, "none failing");
        metrics_set(M_DATABASE_UP, NULL, up);
        /* the rows a probe found locked, not every row of a mark that
         * gave up on a lock: a table lock makes the probe give up too */
        metrics_set(M_EVENTS_LOCKED_BY_OTHER, NULL, (double)r->rows_locked);
        metrics_set(M_LAST_BATCH_TIMESTAMP, NULL, clock_wall_s());
        if (r->http)
                http_heartbeat(r->http);
        (void)now;
}

/* Step: a stop request: lock nothing more, give back what was not produced,
 * wait for the delivery reports owed, mark. */
static void notice_stop(struct relay *r, volatile sig_atomic_t *stop, double now) {
        if (!*stop || r->stopping)
                return;
        r->stopping = 1;
        health_stopping(r->health);
        log_info("relay", "stop requested: finishing the work in hand", "rows_publishing=%lld",
                 r->rows_open);
        for (struct batch *b = r->batches; b; b = b->next)
                b->dirty = 1;
        /* a connection waiting out its backoff retries within the stop's pause */
        for (int c = 0; c < C_COUNT; c++)
                if (db_async_phase(r->conns[c].db) == DB_DOWN &&
                    r->conns[c].retry_at > now + LIFECYCLE_STOP_RETRY_MS / 1000.0)
                        r->conns[c].retry_at = now + LIFECYCLE_STOP_RETRY_MS / 1000.0;
}

/* Whether a stopping relay still has work in hand: rows, a lock statement
 * whose rows are not known yet, messages, a take-back. */
static int owes(const struct relay *r) {
        return r->rows_open > 0 || db_async_phase(r->conns[C_LOCK].db) == DB_BUSY ||
               kafka_outstanding(r->kafka) > 0 || r->take_back_wanted;
}

/* Whether the loop is done: stopping and nothing in hand (or the database
 * stayed out of reach past the grace, or a fatal error). */
static int finished(struct relay *r, double now) {
        if (r->too_old)
                return 1;
        if (!r->stopping && !r->fatal)
                return 0;
        if (!owes(r))
                return 1;
        /* the database is needed to finish: the mark connection for marks,
         * the side connection (and the lock one's clock) for a take-back;
         * rows only another transaction's commit can let the relay mark
         * wait as long as the database would */
        int only_held = r->rows_open > 0 && r->rows_open == r->rows_held_by_other &&
                        kafka_outstanding(r->kafka) == 0;
        int reachable = !only_held && db_async_phase(db_of(r, C_MARK)) >= DB_IDLE &&
                        (!r->take_back_wanted || (db_async_phase(db_of(r, C_SIDE)) >= DB_IDLE &&
                                                  db_async_phase(db_of(r, C_LOCK)) >= DB_IDLE));
        if (reachable) {
                r->stop_deadline = 0;
                return 0;
        }
        if (r->stop_deadline == 0)
                r->stop_deadline = now + STOP_GRACE_S;
        return now > r->stop_deadline;
}

/* The next moment something timed is due (monotonic), for poll's timeout. */
static double next_deadline(const struct relay *r, double now) {
        /* the step that settled the last of a stopping relay's work is what
         * lets it finish: nothing else would wake the loop */
        if ((r->stopping || r->fatal) && !owes(r))
                return now;
        double t = now + 1.0; /* the heartbeat and the health clocks */
        if (r->stop_deadline > 0 && r->stop_deadline < t)
                t = r->stop_deadline;
        for (int c = 0; c < C_COUNT; c++) {
                const struct db *db = r->conns[c].db;
                if (db_async_phase(db) == DB_DOWN && r->conns[c].retry_at < t)
                        t = r->conns[c].retry_at;
                double d = db_async_deadline(db);
                if (d > 0 && d < t)
                        t = d;
        }
        /* a lock that cannot be sent (a statement on the lock connection,
         * holding as many rows as it may, stopping, purging) is no
         * deadline: what lets it go (its answer, a delivery report, a
         * mark's answer) wakes the loop itself; one waiting out its
         * statement's backoff is due when that ends. A deadline already
         * past that nothing can act on would turn the wait into a spin. */
        if (db_async_phase(r->conns[C_LOCK].db) == DB_IDLE && locking(r) && lock_limit(r) > 0) {
                double at = r->lock_wanted ? now : r->next_lock;
                if (r->lock_not_before > at)
                        at = r->lock_not_before;
                if (r->lock_paused_until > at)
                        at = r->lock_paused_until;
                if (r->stmts[r->lock_stmt].retry_at > at)
                        at = r->stmts[r->lock_stmt].retry_at;
                if (at < t)
                        t = at;
        }
        /* the sample, likewise, once the side connection is free */
        if (db_async_phase(r->conns[C_SIDE].db) == DB_IDLE && !r->stopping) {
                double at =
                        r->next_sample > r->side_not_before ? r->next_sample : r->side_not_before;
                if (r->stmts[RELAY_SQL_SAMPLE].retry_at > at)
                        at = r->stmts[RELAY_SQL_SAMPLE].retry_at;
                if (at < t)
                        t = at;
        }
        for (int s = 0; s < RELAY_SQL_COUNT; s++)
                if (r->stmts[s].retry_at > now && r->stmts[s].retry_at < t)
                        t = r->stmts[s].retry_at;
        if (r->next_probe > 0 && db_async_phase(r->conns[C_MARK].db) == DB_IDLE) {
                double at = r->next_probe;
                if (r->stmts[RELAY_SQL_MARK_PROBE].retry_at > at)
                        at = r->stmts[RELAY_SQL_MARK_PROBE].retry_at;
                if (at < t)
                        t = at;
        }
        if (r->oldest_free > 0) {
                double linger = r->oldest_free + MARK_LINGER_S;
                if (linger > now && linger < t)
                        t = linger;
        }
        return t;
}

/* Step: waits until a socket is ready, a signal came, or the next deadline. */
static void wait_for_io(struct relay *r, double now, int wake) {
        struct pollfd fds[C_COUNT + 2];
        int n = 0;
        for (int c = 0; c < C_COUNT; c++) {
                short events = 0;
                int fd = db_async_fd(r->conns[c].db, &events);
                if (fd >= 0)
                        fds[n++] = (struct pollfd){.fd = fd, .events = events};
        }
        fds[n++] = (struct pollfd){.fd = kafka_fd(r->kafka), .events = POLLIN};
        if (wake >= 0)
                fds[n++] = (struct pollfd){.fd = wake, .events = POLLIN};
        /* something to do already: no wait */
        int busy = 0;
        for (struct batch *b = r->batches; b && !busy; b = b->next)
                busy = b->dirty;
        double t = busy ? now : next_deadline(r, now);
        int ms = t <= now ? 0 : (int)((t - now) * 1000) + 1;
        if (poll(fds, (nfds_t)n, ms) < 0 && errno != EINTR)
                log_warn("relay", "poll failed", "err=%s", strerror(errno));
        if (wake >= 0 && fds[n - 1].revents) {
                char drain[64];
                while (read(wake, drain, sizeof drain) > 0)
                        ;
        }
        /* a NOTIFY: rows were committed */
        if (db_async_phase(db_of(r, C_LOCK)) != DB_DOWN) {
                pump(r, C_LOCK, clock_mono_s());
                if (db_async_notified(db_of(r, C_LOCK)))
                        r->lock_wanted = 1;
        }
}

/* ---- life ---------------------------------------------------------------- */

struct relay *relay_new(const struct config *cfg, struct http *http, char *errstr,
                        size_t errstr_size) {
        struct relay *r = calloc(1, sizeof *r);
        char app[200];
        if (!r) {
                snprintf(errstr, errstr_size, "out of memory");
                return NULL;
        }
        r->cfg = cfg;
        r->http = http;
        r->seed = (unsigned)time(NULL) ^ (unsigned)getpid();
        r->lock_stmt = cfg->ordering == ORDERING_NONE ? RELAY_SQL_LOCK_NONE : RELAY_SQL_LOCK;
        r->lock_ramp = LOCK_FIRST_ROWS;
        /* nothing on the side connection (a take-back or a sample over the
         * whole table) competes with the first lock for the server */
        r->side_not_before = clock_mono_s() + SIDE_FIRST_WAIT_S;
        r->indexes_asks = 1; /* the check at start */
        r->health = health_new(health_names, H_COUNT,
                               2.0 * cfg->poll_interval_ms / 1000.0 +
                                       cfg->statement_timeout_ms / 1000.0);
        if (!r->health)
                goto oom;
        for (int c = 0; c < C_COUNT; c++) {
                struct conn *cn = &r->conns[c];
                snprintf(app, sizeof app, "outbox-relay:%s:%s", conn_names[c], cfg->relay_id);
                struct db_session s = {
                        .app_name = app,
                        .statement_timeout_ms = cfg->statement_timeout_ms,
                        .lock_timeout_ms = cfg->db_lock_timeout_ms,
                        .fixed_plans = 1,
                        .listen = c == C_LOCK,
                        .sql = relay_sql,
                        .nsql = RELAY_SQL_COUNT,
                        .test_lock_delay_ms = cfg->test_lock_delay_ms,
                        .test_mark_delay_ms = cfg->test_mark_delay_ms,
                        .test_sample_delay_ms = cfg->test_sample_delay_ms,
                        .test_fetch_fault_version = cfg->test_fetch_fault_version,
                        .test_fetch_kill_version = cfg->test_fetch_kill_version,
                };
                /* each connection prepares the statements it runs; the side
                 * connection's read the whole backlog: a longer timeout */
                if (c == C_LOCK)
                        s.prepare = 1ULL << r->lock_stmt | 1ULL << RELAY_SQL_FETCH;
                else if (c == C_MARK)
                        s.prepare = 1ULL << RELAY_SQL_MARK_PUBLISHED |
                                    1ULL << RELAY_SQL_MARK_PUBLISHED_BY_ID |
                                    1ULL << RELAY_SQL_MARK_UNPUBLISHED |
                                    1ULL << RELAY_SQL_MARK_RELEASED | 1ULL << RELAY_SQL_MARK_PROBE;
                else
                        s.prepare = 1ULL << RELAY_SQL_TAKE_BACK_OWN | 1ULL << RELAY_SQL_SAMPLE |
                                    1ULL << RELAY_SQL_GAPS | 1ULL << RELAY_SQL_HELD |
                                    1ULL << RELAY_SQL_HORIZON | 1ULL << RELAY_SQL_UNPARK |
                                    1ULL << RELAY_SQL_BLOCKERS | 1ULL << RELAY_SQL_INDEXES;
                if (c == C_SIDE)
                        s.statement_timeout_ms = cfg->statement_timeout_ms * 6;
                cn->db = db_new(cfg->database_url, cfg->table, cfg->relay_id);
                if (!cn->db || db_async_configure(cn->db, &s) != 0)
                        goto oom;
                cn->backoff_ms = RECONNECT_MIN_MS;
        }
        r->message = message_new(cfg, errstr, errstr_size);
        if (!r->message)
                goto fail;
        unsigned long long fingerprint;
        int registry;
        if (message_avro(r->message, &fingerprint, &registry))
                log_info("relay", "avro value schema", "fingerprint=%016llx registry=%s",
                         fingerprint,
                         !registry                            ? "no"
                         : cfg->schema_registry_auto_register ? "register"
                                                              : "lookup");
        r->kafka = kafka_new(cfg, on_delivery, on_stats, r, errstr, errstr_size);
        if (!r->kafka)
                goto fail;
        if (http) {
                /* a wave may wait a whole delivery timeout for its report
                 * (broker down): /healthz must not call that a stall */
                http_set_stall(http, kafka_delivery_timeout_ms(r->kafka) / 1000 + 60);
                http_set_ready_fn(http, health_readyz, r->health);
        }
        metrics_set_render_hook(health_refresh_metrics, r->health);
        r->next_sample = clock_mono_s() + 1.0;
        return r;
oom:
        snprintf(errstr, errstr_size, "out of memory");
fail:
        relay_destroy(r);
        return NULL;
}

void relay_destroy(struct relay *r) {
        if (!r)
                return;
        if (r->http)
                http_set_ready_fn(r->http, NULL, NULL);
        metrics_set_render_hook(NULL, NULL);
        kafka_destroy(r->kafka); /* first: its reports point into the batches */
        while (r->batches) {
                struct batch *b = r->batches;
                r->batches = b->next;
                batch_free(b);
        }
        for (int c = 0; c < C_COUNT; c++)
                db_destroy(r->conns[c].db);
        message_destroy(r->message);
        health_destroy(r->health);
        for (int k = 0; k < 6; k++)
                buf_free(&r->mp[k]);
        buf_free(&r->list);
        buf_free(&r->list2);
        buf_free(&r->list3);
        free(r->hot);
        free(r->marking);
        free(r);
}

int relay_run(struct relay *r, volatile sig_atomic_t *stop, int wake) {
        const struct config *cfg = r->cfg;
        log_info("relay", "started", "relay_id=%s table=%s batch_size=%d ordering=%s",
                 cfg->relay_id, cfg->table, cfg->batch_size,
                 cfg->ordering == ORDERING_AGGREGATE    ? "aggregate"
                 : cfg->ordering == ORDERING_INCREASING ? "increasing"
                                                        : "none");
        for (;;) {
                double now = clock_mono_s();
                notice_stop(r, stop, now);
                if (finished(r, now))
                        break;
                keep_connections(r, now);
                serve_kafka(r, now);
                produce(r, now);
                lock_or_fetch(r, now);
                mark(r, now);
                side_work(r, now);
                free_done(r, now);
                report_health(r, now);
                wait_for_io(r, now, wake);
        }
        if (r->too_old) {
                log_error("db", "database server not supported", "err=%s", r->too_old_why);
                return 2;
        }
        int left = r->rows_open > 0 || r->take_back_wanted;
        if (left)
                log_error("relay", "stopping with rows left PUBLISHING for the sweeper",
                          "rows=%lld unknown_lock=%s", r->rows_open,
                          r->take_back_wanted ? "yes" : "no");
        log_info("relay", "stopped", "relay_id=%s", cfg->relay_id);
        return left || r->fatal ? 1 : 0;
}
