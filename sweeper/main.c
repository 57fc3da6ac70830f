/* outbox-sweeper: returns stale PUBLISHING locks and deletes PUBLISHED rows
 * past retention (DESIGN.md). */
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "config.h"
#include "http.h"
#include "log.h"
#include "metrics.h"
#include "sweeper.h"

static volatile sig_atomic_t stop;

static void on_signal(int sig) {
        (void)sig;
        if (stop)
                _exit(1); /* a second signal: exit at once */
        stop = 1;
}

int main(int argc, char **argv) {
        struct config cfg;
        struct http *http = NULL;
        struct sweeper *sweeper = NULL;
        char err[512], url[512];
        int rc = 1;

        int c = config_load(&cfg, CONFIG_SWEEPER, argc, argv, stdout, err, sizeof err);
        if (c == CONFIG_EXIT_HELP || c == CONFIG_EXIT_VERSION) {
                config_destroy(&cfg);
                return 0;
        }
        log_setup(c == 0 ? (enum log_level)cfg.log_level : LOG_INFO, c == 0 && cfg.log_format_json);
        if (c != 0) {
                log_error("config", "bad configuration", "err=%s", log_quote(err));
                config_destroy(&cfg);
                return 2;
        }

        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_signal;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGTERM, &sa, NULL);
        sigaction(SIGINT, &sa, NULL);
        signal(SIGPIPE, SIG_IGN);

        if (metrics_init("outbox-sweeper") != 0) {
                log_error("sweeper", "cannot set up metrics", NULL);
                goto out;
        }
        if (strcmp(cfg.http_addr, "off") != 0) {
                http = http_start(cfg.http_addr, err, sizeof err);
                if (!http) {
                        log_error("http", "cannot listen", "addr=%s err=%s", cfg.http_addr,
                                  log_quote(err));
                        goto out;
                }
                /* a delete loop may run long between heartbeats on a slow table */
                http_set_stall(http, 300);
        }
        config_redact_url(cfg.database_url, url, sizeof url);
        log_info("sweeper", "starting", "version=%s database=%s http=%s", OUTBOX_VERSION,
                 log_quote(url), cfg.http_addr);
        sweeper = sweeper_new(&cfg, http, err, sizeof err);
        if (!sweeper) {
                log_error("sweeper", "cannot start", "err=%s", log_quote(err));
                goto out;
        }
        rc = sweeper_run(sweeper, &stop);
out:
        sweeper_destroy(sweeper);
        http_stop(http);
        metrics_destroy();
        config_destroy(&cfg);
        return rc;
}
