/* lifecycle.c - start-up, naps and reconnects shared by both daemons. */
#include "lifecycle.h"

#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "db_conninfo.h"
#include "log.h"
#include "metrics.h"

static volatile sig_atomic_t stop_requested;

/* Only sets the flag; the loops see it. A second signal exits at once. */
static void on_signal(int sig) {
        (void)sig;
        if (stop_requested)
                _exit(1);
        stop_requested = 1;
}

int lifecycle_start(struct lifecycle *lc, enum config_program prog, int argc, char **argv,
                    lifecycle_check *check) {
        const char *name = prog == CONFIG_RELAY ? "outbox-relay" : "outbox-sweeper";
        const char *mod = prog == CONFIG_RELAY ? "relay" : "sweeper";
        char err[512], url[512];

        memset(lc, 0, sizeof *lc);
        lc->stop = &stop_requested;
        int c = config_load(&lc->cfg, prog, argc, argv, stdout, err, sizeof err);
        if (c == CONFIG_EXIT_HELP || c == CONFIG_EXIT_VERSION)
                return 0;
        log_setup(c == 0 ? (enum log_level)lc->cfg.log_level : LOG_INFO,
                  c == 0 && lc->cfg.log_format_json);
        if (c != 0 || (check && check(&lc->cfg, err, sizeof err) != 0)) {
                log_error("config", "bad configuration", "err=%s", err);
                return 2;
        }

        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_signal;
        sigemptyset(&sa.sa_mask);
        if (sigaction(SIGTERM, &sa, NULL) != 0 || sigaction(SIGINT, &sa, NULL) != 0 ||
            signal(SIGPIPE, SIG_IGN) == SIG_ERR) {
                log_error(mod, "cannot install signal handlers", NULL);
                return 1;
        }
        if (metrics_init(name) != 0) {
                log_error(mod, "cannot set up metrics", NULL);
                return 1;
        }
        if (strcmp(lc->cfg.http_addr, "off") != 0) {
                lc->http = http_start(lc->cfg.http_addr, err, sizeof err);
                if (!lc->http) {
                        log_error("http", "cannot listen", "addr=%s err=%s", lc->cfg.http_addr,
                                  err);
                        return 1;
                }
        }
        db_conninfo_redact(lc->cfg.database_url, url, sizeof url);
        log_info(mod, "starting", "version=%s database=%s http=%s", OUTBOX_VERSION, url,
                 lc->cfg.http_addr);
        return -1;
}

void lifecycle_finish(struct lifecycle *lc) {
        http_stop(lc->http);
        lc->http = NULL;
        metrics_destroy();
        config_destroy(&lc->cfg);
}

void lifecycle_nap(struct http *http, long long ms, volatile sig_atomic_t *stop) {
        while (ms > 0 && !*stop) {
                long long step = ms < 100 ? ms : 100;
                struct timespec ts = {0, (long)step * 1000000L};
                nanosleep(&ts, NULL);
                ms -= step;
                if (http)
                        http_heartbeat(http);
        }
}

void lifecycle_backoff(struct http *http, int *backoff_ms, volatile sig_atomic_t *stop) {
        lifecycle_nap(http, *backoff_ms, stop);
        *backoff_ms = *backoff_ms > LIFECYCLE_RECONNECT_MAX_MS / 2 ? LIFECYCLE_RECONNECT_MAX_MS
                                                                   : *backoff_ms * 2;
}

int lifecycle_ensure_db(struct db *db, int *backoff_ms, struct http *http,
                        volatile sig_atomic_t *stop) {
        char err[512];
        if (db_connected(db))
                return 0;
        if (db_connect(db, err, sizeof err) == 0) {
                log_info("db", "connected", NULL);
                *backoff_ms = LIFECYCLE_RECONNECT_MIN_MS;
                return 0;
        }
        log_warn("db", "cannot connect, retrying", "retry_ms=%d err=%s", *backoff_ms, err);
        if (http)
                http_set_ready(http, 0);
        lifecycle_backoff(http, backoff_ms, stop);
        return -1;
}
