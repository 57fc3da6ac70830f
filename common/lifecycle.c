/* lifecycle.c - start-up, naps and reconnects shared by both daemons. */
#include "lifecycle.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "db_async.h"
#include "db_conninfo.h"
#include "log.h"
#include "metrics.h"

/* Signals: the handler only sets flags and posts a semaphore
 * (async-signal-safe); a watcher thread does what needs the log. SIGTERM or
 * SIGINT asks the loops to stop; a second one exits at once (after the
 * watcher's line; a third exits even if the watcher is stuck). SIGHUP is
 * logged and ignored (configuration is read only at start); SIGUSR1 turns on
 * debug logging, SIGUSR2 restores the configured level. */
static volatile sig_atomic_t stop_requested;
static volatile sig_atomic_t stop_signals, hup_pending, usr1_pending, usr2_pending;
static sem_t watcher_wake;
static pthread_t watcher;
static int watcher_running;
static atomic_int watcher_quit;
static atomic_long rows_held;
static int wake_pipe[2] = {-1, -1}; /* the handler writes, the main loop polls */
static enum log_level configured_level;

static void on_signal(int sig) {
        int saved = errno;
        switch (sig) {
        case SIGTERM:
        case SIGINT:
                if (stop_signals >= 2)
                        _exit(1);
                stop_signals++;
                stop_requested = 1;
                break;
        case SIGHUP: hup_pending = 1; break;
        case SIGUSR1: usr1_pending = 1; break;
        case SIGUSR2: usr2_pending = 1; break;
        }
        sem_post(&watcher_wake);
        if (wake_pipe[1] >= 0 && write(wake_pipe[1], "s", 1) < 0) {
                /* full: the loop has a wake-up waiting already */
        }
        errno = saved;
}

int lifecycle_wake_fd(void) {
        return wake_pipe[0];
}

void lifecycle_set_rows_held(long rows) {
        atomic_store(&rows_held, rows);
}

static void *watch_signals(void *arg) {
        const char *mod = arg;
        for (;;) {
                while (sem_wait(&watcher_wake) != 0 && errno == EINTR)
                        ;
                if (atomic_load(&watcher_quit))
                        return NULL;
                if (stop_signals >= 2) {
                        log_error(mod, "second stop signal: exiting at once", "rows_publishing=%ld",
                                  atomic_load(&rows_held));
                        _exit(1);
                }
                if (hup_pending) {
                        hup_pending = 0;
                        log_info(mod, "SIGHUP ignored: configuration is read only at start", NULL);
                }
                if (usr1_pending) {
                        usr1_pending = 0;
                        log_setup_level(LOG_DEBUG);
                        log_info(mod, "log level debug (SIGUSR1; SIGUSR2 restores it)", NULL);
                }
                if (usr2_pending) {
                        usr2_pending = 0;
                        log_setup_level(configured_level);
                        log_info(mod, "log level restored (SIGUSR2)", NULL);
                }
        }
}

/* Blocks (SIG_BLOCK) or unblocks (SIG_UNBLOCK) the handled signals in the
 * calling thread; threads it creates meanwhile inherit the mask. */
static void signals_mask(int how) {
        sigset_t set;
        sigemptyset(&set);
        sigaddset(&set, SIGTERM);
        sigaddset(&set, SIGINT);
        sigaddset(&set, SIGHUP);
        sigaddset(&set, SIGUSR1);
        sigaddset(&set, SIGUSR2);
        pthread_sigmask(how, &set, NULL);
}

/* Installs the handlers and starts the watcher; 0 or -1. */
static int signals_start(const char *mod) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_signal;
        sigemptyset(&sa.sa_mask);
        if (sem_init(&watcher_wake, 0, 0) != 0)
                return -1;
        if (pipe(wake_pipe) != 0 || fcntl(wake_pipe[0], F_SETFL, O_NONBLOCK) != 0 ||
            fcntl(wake_pipe[1], F_SETFL, O_NONBLOCK) != 0)
                return -1;
        if (pthread_create(&watcher, NULL, watch_signals, (void *)mod) != 0) {
                sem_destroy(&watcher_wake);
                return -1;
        }
        watcher_running = 1;
        int sigs[] = {SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2};
        for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++)
                if (sigaction(sigs[i], &sa, NULL) != 0)
                        return -1;
        return signal(SIGPIPE, SIG_IGN) == SIG_ERR ? -1 : 0;
}

static void signals_stop(void) {
        if (!watcher_running)
                return;
        atomic_store(&watcher_quit, 1);
        sem_post(&watcher_wake);
        pthread_join(watcher, NULL);
        sem_destroy(&watcher_wake);
        watcher_running = 0;
        for (int i = 0; i < 2; i++)
                if (wake_pipe[i] >= 0)
                        close(wake_pipe[i]);
        wake_pipe[0] = wake_pipe[1] = -1;
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
                  c == 0 ? lc->cfg.log_format_json : config_log_json_hint(prog, argc, argv));
        if (c != 0 || (check && check(&lc->cfg, err, sizeof err) != 0)) {
                log_error("config", "bad configuration", "err=%s", err);
                return 2;
        }

        configured_level = (enum log_level)lc->cfg.log_level;
        /* The threads started here (the watcher, the HTTP server's) never take
         * a stop signal: it must interrupt the main thread's wait (poll(),
         * nanosleep()) to be seen before the wait ends. Unblocked below. */
        signals_mask(SIG_BLOCK);
        if (signals_start(mod) != 0) {
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
        signals_mask(SIG_UNBLOCK);
        db_conninfo_redact(lc->cfg.database_url, url, sizeof url);
        log_info(mod, "starting", "version=%s schema=%s database=%s http=%s", OUTBOX_VERSION,
                 OUTBOX_SCHEMA_LEVEL, url, lc->cfg.http_addr);
        return -1;
}

void lifecycle_finish(struct lifecycle *lc) {
        signals_stop();
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

int lifecycle_retry_ms(int backoff_ms, volatile sig_atomic_t *stop) {
        return *stop ? LIFECYCLE_STOP_RETRY_MS : backoff_ms;
}

void lifecycle_backoff(struct http *http, int *backoff_ms, volatile sig_atomic_t *stop) {
        lifecycle_nap(http, *backoff_ms, stop);
        *backoff_ms = *backoff_ms > LIFECYCLE_RECONNECT_MAX_MS / 2 ? LIFECYCLE_RECONNECT_MAX_MS
                                                                   : *backoff_ms * 2;
}

static int server_refused;

int lifecycle_refused(void) {
        return server_refused;
}

int lifecycle_ensure_db(struct db *db, int *backoff_ms, struct http *http,
                        volatile sig_atomic_t *stop) {
        char err[512];
        if (db_connected(db))
                return 0;
        int rc = db_connect(db, err, sizeof err);
        if (rc == 0) {
                log_info("db", "connected", NULL);
                *backoff_ms = LIFECYCLE_RECONNECT_MIN_MS;
                return 0;
        }
        if (rc == DB_ERR_SERVER_VERSION) {
                log_error("db", "database server not supported", "err=%s", err);
                server_refused = 1;
                *stop = 1;
                return -1;
        }
        log_warn("db",
                 db_async_table_locked(db) ? "table locked by another session, retrying"
                                           : "cannot connect, retrying",
                 "retry_ms=%d err=%s", lifecycle_retry_ms(*backoff_ms, stop), err);
        lifecycle_backoff(http, backoff_ms, stop);
        return -1;
}
