/* outbox-relay: publishes PostgreSQL outbox rows to Kafka (DESIGN.md). */
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "config.h"
#include "http.h"
#include "kafka.h"
#include "log.h"
#include "metrics.h"
#include "relay.h"

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
        struct relay *relay = NULL;
        char err[512], url[512];
        int rc = 1;

        int c = config_load(&cfg, CONFIG_RELAY, argc, argv, stdout, err, sizeof err);
        if (c == CONFIG_EXIT_HELP || c == CONFIG_EXIT_VERSION) {
                config_destroy(&cfg);
                return 0;
        }
        log_setup(c == 0 ? (enum log_level)cfg.log_level : LOG_INFO, c == 0 && cfg.log_format_json);
        if (c != 0 || kafka_conf_check(&cfg, err, sizeof err) != 0) {
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

        if (metrics_init("outbox-relay") != 0) {
                log_error("relay", "cannot set up metrics", NULL);
                goto out;
        }
        if (strcmp(cfg.http_addr, "off") != 0) {
                http = http_start(cfg.http_addr, err, sizeof err);
                if (!http) {
                        log_error("http", "cannot listen", "addr=%s err=%s", cfg.http_addr,
                                  log_quote(err));
                        goto out;
                }
        }
        config_redact_url(cfg.database_url, url, sizeof url);
        log_info("relay", "starting", "version=%s database=%s http=%s", OUTBOX_VERSION,
                 log_quote(url), cfg.http_addr);
        relay = relay_new(&cfg, http, err, sizeof err);
        if (!relay) {
                log_error("relay", "cannot start", "err=%s", log_quote(err));
                goto out;
        }
        rc = relay_run(relay, &stop);
out:
        relay_destroy(relay);
        http_stop(http);
        metrics_destroy();
        config_destroy(&cfg);
        return rc;
}
