/* sweeper.c - stale-lock reset, parking and retention delete, in small transactions. */
#include "sweeper.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "db.h"
#include "db_async.h"
#include "errstr.h"
#include "health.h"
#include "indexes.h"
#include "lifecycle.h"
#include "log.h"
#include "metrics.h"
#include "sweeper_sql.h"

/* Rows per parking statement, in OUTBOX_DELETE_BATCH: parking is one pass
 * over a queue that may be long, each statement reading the parked range
 * once. */
#define PARK_BATCH_FACTOR 10

/* The readiness conditions. */
enum { H_DATABASE, H_TABLE, H_SWEEP, H_COUNT };
static const char *const health_names[H_COUNT] = {"database", "table", "sweep"};

struct sweeper {
        const struct config *cfg;
        struct http *http;
        struct health *health;
        struct db *db;
        int reconnect_ms;
        int stop_logged;
        int indexes_wanted; /* check the indexes once connected (at start, and
                             * when a statement starts to time out) */
        int timing_out;     /* a statement timed out in the last sweep */
        int timeouts;       /* statement timeouts, all told */
        /* the error the last sweep and the last parking failed with ("":
         * they worked), so that one cause is logged when it starts and when
         * it ends, not at every sweep */
        char sweep_failing[512], park_failing[512];
};

static void beat(struct sweeper *s) {
        if (s->http)
                http_heartbeat(s->http);
}

static void nap(struct sweeper *s, long long ms, volatile sig_atomic_t *stop) {
        lifecycle_nap(s->http, ms, stop);
}

struct sweeper *sweeper_new(const struct config *cfg, struct http *http, char *errstr,
                            size_t errstr_size) {
        struct sweeper *s = calloc(1, sizeof *s);
        if (!s) {
                snprintf(errstr, errstr_size, "out of memory");
                return NULL;
        }
        s->cfg = cfg;
        s->http = http;
        s->reconnect_ms = LIFECYCLE_RECONNECT_MIN_MS;
        s->indexes_wanted = 1;
        s->db = db_new(cfg->database_url, cfg->table, cfg->relay_id);
        s->health = health_new(health_names, H_COUNT, 0);
        /* The sweeper's statements read whole ranges of a backlog: a longer
         * statement timeout than the relay's, the same lock timeout. */
        struct db_session session = {.app_name = "outbox-sweeper",
                                     .statement_timeout_ms = cfg->statement_timeout_ms * 6,
                                     .lock_timeout_ms = cfg->db_lock_timeout_ms,
                                     .sql = sweeper_sql,
                                     .nsql = SWEEPER_SQL_COUNT};
        if (!s->db || !s->health || db_async_configure(s->db, &session) != 0) {
                snprintf(errstr, errstr_size, "out of memory");
                sweeper_destroy(s);
                return NULL;
        }
        if (http)
                http_set_ready_fn(http, health_readyz, s->health);
        metrics_set_render_hook(health_refresh_metrics, s->health);
        return s;
}

void sweeper_destroy(struct sweeper *s) {
        if (!s)
                return;
        if (s->http)
                http_set_ready_fn(s->http, NULL, NULL);
        metrics_set_render_hook(NULL, NULL);
        db_destroy(s->db);
        health_destroy(s->health);
        free(s);
}

/* Runs statement `stmt` (sweeper/sql, common/sql) with the text
 * parameters `params`: its answer, or NULL with errstr
 * "<statement>: <why>", counted in outbox_statement_errors_total, and the
 * connection dropped when a new session would cure it (the table changed
 * under the prepared statements) or it was lost. A statement that starts
 * to time out asks for the index check: without its index it reads far
 * more of the table. */
static struct db_result *run_text(struct sweeper *s, int stmt, int n, const char *const *params,
                                  char *errstr, size_t size) {
        const char *name = sweeper_sql[stmt].name;
        if (!db_connected(s->db)) {
                errstr_set(errstr, size, "%s: not connected", name);
                return NULL;
        }
        char why[512] = "";
        struct db_result *res = db_exec(s->db, stmt, n, params, 0, why, sizeof why);
        if (res && db_result_ok(res))
                return res;
        const char *state = res ? db_result_sqlstate(res) : "";
        size_t len = strlen(name);
        if (!res && !strncmp(why, name, len) && why[len] == ':')
                errstr_set(errstr, size, "%s", why); /* not sent: it names the statement */
        else if (!res)
                errstr_set(errstr, size, "%s: %s", name, why);
        else if (!*state && *why) /* lost before the answer: libpq says why */
                errstr_set(errstr, size, "%s: %s (%s)", name, db_result_error(res), why);
        else
                errstr_set(errstr, size, "%s: %s", name, db_result_error(res));
        metrics_add2(M_STATEMENT_ERRORS, name, state, 1);
        if (!strcmp(state, "57014")) {
                s->timeouts++;
                if (!s->timing_out)
                        s->indexes_wanted = 1;
                s->timing_out = 1;
        }
        if (db_fault_of(state) == DB_FAULT_SESSION)
                db_disconnect(s->db);
        db_result_free(res);
        return NULL;
}

/* run_text() with integer parameters. */
static struct db_result *run(struct sweeper *s, int stmt, int n, const long long *args,
                             char *errstr, size_t size) {
        char text[3][24];
        const char *params[3];
        if (n > 3) {
                errstr_set(errstr, size, "%s: more than 3 parameters", sweeper_sql[stmt].name);
                return NULL;
        }
        for (int i = 0; i < n; i++) {
                snprintf(text[i], sizeof text[i], "%lld", args[i]);
                params[i] = text[i];
        }
        return run_text(s, stmt, n, params, errstr, size);
}

/* Whether retention keeps each aggregate's latest published row. */
static int keeps_latest(const struct config *cfg) {
        return cfg->ordering == ORDERING_AGGREGATE && cfg->retention_keep_latest;
}

/* The index check (common/sql/indexes.sql) for the indexes this sweeper's
 * statements read: the due index (stale locks, parking), and with
 * retention its index and, keeping the latest rows, the published guard
 * index. It informs and nothing waits for it: a failed check is logged and
 * runs again only when a statement next starts to time out. */
static void check_indexes(struct sweeper *s) {
        const struct config *cfg = s->cfg;
        const char *params[1] = {cfg->retention_s == 0 ? "{due}"
                                 : keeps_latest(cfg)   ? "{due,retention,published}"
                                                       : "{due,retention}"};
        char err[512];
        s->indexes_wanted = 0;
        struct db_result *res = run_text(s, SWEEPER_SQL_INDEXES, 1, params, err, sizeof err);
        if (!res) {
                log_warn("sweeper", "index check failed", "err=%s", err);
                return;
        }
        indexes_log("sweeper", res);
        db_result_free(res);
}

/* Runs a statement whose answer is one row of `n` counts. */
static int counts_of(struct sweeper *s, int stmt, int nargs, const long long *args,
                     long long *counts, int n, char *errstr, size_t size) {
        for (int i = 0; i < n; i++)
                counts[i] = 0;
        struct db_result *res = run(s, stmt, nargs, args, errstr, size);
        if (!res)
                return -1;
        int rc = 0;
        if (db_result_rows(res) != 1 || db_result_cols(res) != n)
                rc = errstr_set(errstr, size, "%s: unexpected answer", sweeper_sql[stmt].name);
        for (int i = 0; rc == 0 && i < n; i++)
                counts[i] = strtoll(db_result_value(res, 0, i), NULL, 10);
        db_result_free(res);
        return rc;
}

/* Versions behind a DEAD one (docs/DESIGN.md, "The sweeper"): unpark
 * first, so a requeued aggregate flows again this sweep, then park. A
 * failure is logged and the sweep goes on to retention (e.g. a table whose
 * check 003_park_blocked.sql has not widened yet refuses every park). */
static void park(struct sweeper *s, volatile sig_atomic_t *stop, struct sweep_result *res) {
        const struct config *cfg = s->cfg;
        int ordered = cfg->ordering != ORDERING_NONE;
        int batch = cfg->delete_batch > INT_MAX / PARK_BATCH_FACTOR
                            ? INT_MAX
                            : cfg->delete_batch * PARK_BATCH_FACTOR;
        char err[512];
        long long n;
        do {
                /* every parked version when nothing is held (ordering none) */
                long long args[2] = {batch, !ordered};
                if (counts_of(s, SWEEPER_SQL_UNPARK, 2, args, &n, 1, err, sizeof err) != 0)
                        goto fail;
                res->unparked += n;
                beat(s);
        } while (n >= batch && !*stop);
        if (res->unparked)
                log_info("sweeper", "parked versions due again", "rows=%lld", res->unparked);
        if (ordered && !*stop)
                do {
                        long long args[1] = {batch};
                        struct db_result *r =
                                run(s, SWEEPER_SQL_PARK_BLOCKED, 1, args, err, sizeof err);
                        if (!r)
                                goto fail;
                        n = db_result_changed(r);
                        db_result_free(r);
                        res->parked += n;
                        beat(s);
                } while (n >= batch && !*stop);
        if (res->parked)
                log_warn("sweeper", "versions parked behind DEAD versions of their aggregate",
                         "rows=%lld", res->parked);
        if (*s->park_failing)
                log_info("sweeper", "parking works again", NULL);
        s->park_failing[0] = '\0';
        return;
fail:
        /* one line when it starts failing or its error changes */
        if (strcmp(s->park_failing, err) != 0)
                log_warn("sweeper", "parking failed, going on", "err=%s", err);
        else
                log_debug("sweeper", "parking failed, going on", "err=%s", err);
        snprintf(s->park_failing, sizeof s->park_failing, "%s", err);
}

int sweeper_sweep(struct sweeper *s, volatile sig_atomic_t *stop, struct sweep_result *res,
                  char *errstr, size_t errstr_size) {
        const struct config *cfg = s->cfg;
        long long n;

        res->stale_reset = res->deleted = res->parked = res->unparked = 0;
        res->statements = 0;
        /* Stale locks first: they hold up whole aggregates. */
        long long dead_total = 0;
        do {
                long long args[3] = {cfg->lock_timeout_s, cfg->delete_batch, cfg->max_attempts};
                long long got[2]; /* reset, of those DEAD */
                if (counts_of(s, SWEEPER_SQL_RESET_STALE, 3, args, got, 2, errstr, errstr_size) !=
                    0)
                        return -1;
                n = got[0];
                res->stale_reset += n;
                dead_total += got[1];
                metrics_add(M_SWEEPER_STALE_RESET, NULL, (double)n);
                beat(s);
        } while (n >= cfg->delete_batch && !*stop);
        if (res->stale_reset)
                log_warn("sweeper", "stale locks returned", "rows=%lld dead=%lld lock_timeout_s=%d",
                         res->stale_reset, dead_total, cfg->lock_timeout_s);
        if (dead_total)
                log_warn("sweeper", "stale locks with their attempts used up went DEAD",
                         "rows=%lld max_attempts=%d", dead_total, cfg->max_attempts);

        if (!*stop)
                park(s, stop, res);
        if (cfg->retention_s == 0 || *stop)
                return 0;
        /* Consecutive versions, if asked: each aggregate's latest published
         * row stays, so a version after it is never taken for the
         * aggregate's first (a gap right after it is seen). */
        int keep_latest = keeps_latest(cfg);
        long long seen;
        do {
                long long args[2] = {cfg->retention_s, cfg->delete_batch};
                long long got[2]; /* deleted, looked at */
                if (counts_of(s,
                              keep_latest ? SWEEPER_SQL_DELETE_KEEP_LATEST
                                          : SWEEPER_SQL_DELETE_PUBLISHED,
                              2, args, got, 2, errstr, errstr_size) != 0)
                        return -1;
                n = got[0];
                seen = got[1];
                res->deleted += n;
                res->statements++;
                metrics_add(M_SWEEPER_DELETED, NULL, (double)n);
                beat(s);
        } while (seen >= cfg->delete_batch && !*stop);
        return 0;
}

/* Connects if needed (ready once connected); on failure waits the backoff
 * and returns -1. */
static int ensure_db(struct sweeper *s, volatile sig_atomic_t *stop) {
        if (lifecycle_ensure_db(s->db, &s->reconnect_ms, s->http, stop) != 0) {
                int missing = db_async_table_missing(s->db);
                health_set(s->health, H_DATABASE, missing, "%s",
                           missing ? "connected" : "cannot connect (see the log)");
                if (missing)
                        health_set(s->health, H_TABLE, 0, "table %s does not exist", s->cfg->table);
                return -1;
        }
        health_set(s->health, H_DATABASE, 1, "connected");
        health_set(s->health, H_TABLE, 1, "%s", db_table_name(s->db));
        return 0;
}

/* One sweep, logged. 0 when it completed. */
static int sweep_once(struct sweeper *s, volatile sig_atomic_t *stop) {
        struct sweep_result res;
        char err[512];
        double started = clock_mono_s();
        int timeouts = s->timeouts;
        int rc = sweeper_sweep(s, stop, &res, err, sizeof err);
        if (rc != 0) {
                /* one line when it starts failing or its error changes */
                if (strcmp(s->sweep_failing, err) != 0)
                        log_warn("sweeper", "sweep failed", "stale_reset=%lld deleted=%lld err=%s",
                                 res.stale_reset, res.deleted, err);
                else
                        log_debug("sweeper", "sweep failed", "stale_reset=%lld deleted=%lld err=%s",
                                  res.stale_reset, res.deleted, err);
                snprintf(s->sweep_failing, sizeof s->sweep_failing, "%s", err);
                health_set(s->health, H_SWEEP, 0, "sweep failed: %s", err);
                if (!db_connected(s->db))
                        health_set(s->health, H_DATABASE, 0, "connection lost");
                return -1;
        }
        health_set(s->health, H_SWEEP, 1, "last sweep completed");
        if (*s->sweep_failing)
                log_info("sweeper", "sweep works again", NULL);
        s->sweep_failing[0] = '\0';
        /* timed out no more: a later timeout checks the indexes again (a
         * sweep whose parking timed out completes, but is still timing out) */
        if (s->timeouts == timeouts)
                s->timing_out = 0;
        if (res.stale_reset || res.deleted || res.parked || res.unparked)
                log_info("sweeper", "sweep done",
                         "stale_reset=%lld parked=%lld unparked=%lld deleted=%lld statements=%d "
                         "seconds=%.3f",
                         res.stale_reset, res.parked, res.unparked, res.deleted, res.statements,
                         clock_mono_s() - started);
        else
                log_debug("sweeper", "sweep done",
                          "stale_reset=0 deleted=0 statements=%d seconds=%.3f", res.statements,
                          clock_mono_s() - started);
        return 0;
}

/* The index check, when one is wanted: before the sweep, whose running it
 * gates in nothing (its findings are only logged). */
static void indexes(struct sweeper *s) {
        if (s->indexes_wanted)
                check_indexes(s);
}

/* Says once that a stop was asked for. */
static void notice_stop(struct sweeper *s, volatile sig_atomic_t *stop) {
        if (*stop && !s->stop_logged) {
                s->stop_logged = 1;
                health_stopping(s->health);
                log_info("sweeper", "stop requested: finishing the statement in hand", NULL);
        }
}

int sweeper_run(struct sweeper *s, volatile sig_atomic_t *stop) {
        const struct config *cfg = s->cfg;
        log_info("sweeper", "started",
                 "mode=%s table=%s lock_timeout_s=%d retention_s=%lld delete_batch=%d "
                 "sweep_interval_s=%d",
                 cfg->once ? "once" : "loop", cfg->table, cfg->lock_timeout_s, cfg->retention_s,
                 cfg->delete_batch, cfg->sweep_interval_s);
        if (cfg->once) {
                double deadline = clock_mono_s() + SWEEPER_ONCE_RETRY_S;
                while (!*stop) {
                        beat(s);
                        if (ensure_db(s, stop) == 0) {
                                indexes(s);
                                if (sweep_once(s, stop) == 0)
                                        return 0;
                        }
                        if (clock_mono_s() > deadline) {
                                log_error("sweeper", "giving up: sweep not completed", "retry_s=%d",
                                          SWEEPER_ONCE_RETRY_S);
                                return 1;
                        }
                        if (db_connected(s->db)) /* a failed statement, not a lost database */
                                nap(s, 1000, stop);
                }
                notice_stop(s, stop);
                log_info("sweeper", "stopped", NULL);
                return 0;
        }
        while (!*stop) {
                beat(s);
                if (ensure_db(s, stop) != 0)
                        continue;
                indexes(s);
                if (sweep_once(s, stop) != 0) {
                        if (db_connected(s->db))
                                nap(s, 1000, stop);
                        continue;
                }
                nap(s, (long long)cfg->sweep_interval_s * 1000, stop);
        }
        notice_stop(s, stop);
        log_info("sweeper", "stopped", NULL);
        return 0;
}
