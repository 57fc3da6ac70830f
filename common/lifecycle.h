/* lifecycle.h - what outbox-relay and outbox-sweeper share around their main
 * loops: configuration, logging, signals, metrics and the HTTP endpoints at
 * start, an interruptible nap, and reconnecting to the database with backoff. */
#ifndef OUTBOX_LIFECYCLE_H
#define OUTBOX_LIFECYCLE_H

#include <signal.h>

#include "config.h"
#include "db.h"
#include "http.h"

/* The process-wide state lifecycle_start() builds. */
struct lifecycle {
        struct config cfg;
        struct http *http;           /* NULL with OUTBOX_HTTP_ADDR=off */
        volatile sig_atomic_t *stop; /* set by SIGTERM/SIGINT; a second one exits at once */
};

/* How many rows this process holds in PUBLISHING now: the line a second
 * stop signal writes before exiting at once says so. */
void lifecycle_set_rows_held(long rows);

/* A descriptor that turns readable when a signal arrived (poll it to wake
 * for a stop request); -1 before lifecycle_start(). */
int lifecycle_wake_fd(void);

/* Extra validation of a loaded configuration (the relay's librdkafka
 * properties): 0, or -1 with errstr naming the variable. */
typedef int(lifecycle_check)(const struct config *cfg, char *errstr, size_t errstr_size);

/* Loads the configuration (`check` may be NULL), sets up logging, the signal
 * handlers (SIGTERM/SIGINT stop; SIGHUP is ignored; SIGUSR1 turns debug
 * logging on and SIGUSR2 off), metrics and the HTTP server, and logs the
 * start with the database URL redacted. Returns -1 when the program should go on, else the exit
 * code to return at once: 0 after --help/--version, 2 for bad configuration, 1 for a runtime
 * failure. Call lifecycle_finish() in every case. */
int lifecycle_start(struct lifecycle *lc, enum config_program prog, int argc, char **argv,
                    lifecycle_check *check) __attribute__((warn_unused_result));

/* Stops the HTTP server, frees metrics and configuration. */
void lifecycle_finish(struct lifecycle *lc);

/* Sleeps up to ms in steps of 100 ms, waking early when *stop is set, and
 * keeps /healthz alive meanwhile (http may be NULL). */
void lifecycle_nap(struct http *http, long long ms, volatile sig_atomic_t *stop);

#define LIFECYCLE_RECONNECT_MIN_MS 100
#define LIFECYCLE_RECONNECT_MAX_MS 5000
/* After a stop request, naps end at once; callers that retry until a stop
 * deadline pause this long between tries instead of the backoff. */
#define LIFECYCLE_STOP_RETRY_MS 200

/* The wait before the next retry, as a log line should state it: the
 * backoff, or LIFECYCLE_STOP_RETRY_MS after a stop request. */
int lifecycle_retry_ms(int backoff_ms, volatile sig_atomic_t *stop);

/* Naps *backoff_ms (see lifecycle_nap), then doubles it up to
 * LIFECYCLE_RECONNECT_MAX_MS. */
void lifecycle_backoff(struct http *http, int *backoff_ms, volatile sig_atomic_t *stop);

/* 0 when db is connected (connecting now if it is not; *backoff_ms then goes
 * back to the minimum). Otherwise logs why, reports not-ready, naps
 * *backoff_ms, doubles it up to LIFECYCLE_RECONNECT_MAX_MS and returns -1.
 * Start *backoff_ms at LIFECYCLE_RECONNECT_MIN_MS. A server older than the
 * programs support (DB_ERR_SERVER_VERSION) is logged as an error, sets *stop
 * and makes lifecycle_refused() true; -1 is returned at once. */
int lifecycle_ensure_db(struct db *db, int *backoff_ms, struct http *http,
                        volatile sig_atomic_t *stop);

/* Nonzero once lifecycle_ensure_db() met a database server the programs do
 * not support: main then exits 2. */
int lifecycle_refused(void);

#endif
