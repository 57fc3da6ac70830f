/* outboxctl: operator commands for the outbox table and its topics
 * (docs/DESIGN.md, "outboxctl"). Reads the environment only. */
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "config.h"
#include "ctl.h"
#include "ctl_args.h"
#include "db.h"
#include "log.h"

long long ctl_now_ms(void) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void print_help(void) {
        ctl_usage(stdout, CTL_NONE);
        printf("\nSettings (environment only):\n");
        config_print_settings(stdout, CONFIG_CTL);
        printf("  OUTBOX_KAFKA_*               librdkafka properties, as for the relay "
               "(reconcile)\n"
               "\nExit codes: 0 ok, 1 a problem found (reconcile: missing or reorders; "
               "replay: rows refused;\nrelease-gap: no gap) or a runtime error, 2 usage or "
               "bad configuration, 3 reconcile cannot tell\n(partitions it could not read: "
               "rows not found may be there).\n");
}

/* Nonzero when bootstrap.servers is set. */
static int have_bootstrap(const struct config *cfg) {
        for (size_t i = 0; i < cfg->kafka_cnt; i++)
                if (!strcmp(cfg->kafka[i].name, "bootstrap.servers") && *cfg->kafka[i].value)
                        return 1;
        return 0;
}

static int run(struct ctl *c) {
        switch (c->args->cmd) {
        case CTL_STATS: return ctl_stats(c);
        case CTL_DEAD: return ctl_dead(c);
        case CTL_REQUEUE: return ctl_requeue(c);
        case CTL_GAPS: return ctl_gaps(c);
        case CTL_RELEASE_GAP: return ctl_release_gap(c);
        case CTL_REPLAY: return ctl_replay(c);
        case CTL_RECONCILE: return ctl_reconcile(c);
        case CTL_NONE: break;
        }
        return 2;
}

int main(int argc, char **argv) {
        struct ctl_args args;
        struct config cfg;
        struct db *db = NULL;
        char err[512];
        int rc = 2;
        char *env_only[] = {argv[0], NULL};

        memset(&cfg, 0, sizeof cfg);
        int parsed = ctl_args_parse(&args, argc, argv, ctl_now_ms(), err, sizeof err);
        if (parsed == 0 && args.help) {
                if (args.cmd == CTL_NONE)
                        print_help();
                else
                        ctl_usage(stdout, args.cmd);
                rc = 0;
                goto out;
        }
        log_setup(LOG_INFO, config_log_json_hint(CONFIG_CTL, 1, env_only));
        if (parsed != 0) {
                log_error("outboxctl", "bad usage", "err=%s", err);
                goto out;
        }
        if (config_load(&cfg, CONFIG_CTL, 1, env_only, stdout, err, sizeof err) != 0) {
                log_error("config", "bad configuration", "err=%s", err);
                goto out;
        }
        log_setup((enum log_level)cfg.log_level, cfg.log_format_json);
        if (args.cmd == CTL_RECONCILE && !have_bootstrap(&cfg)) {
                log_error("config", "bad configuration", "err=%s",
                          "OUTBOX_KAFKA_BOOTSTRAP_SERVERS: required by reconcile "
                          "but not set");
                goto out;
        }
        rc = 1;
        db = db_new(cfg.database_url, cfg.table, "outboxctl");
        if (!db || db_set_admin(db, cfg.topic_template) != 0) {
                log_error("outboxctl", "out of memory", NULL);
                goto out;
        }
        if (db_connect(db, err, sizeof err) != 0) {
                log_error("db", "cannot connect", "err=%s", err);
                goto out;
        }
        struct ctl c = {&cfg, &args, db};
        rc = run(&c);
out:
        db_destroy(db);
        config_destroy(&cfg);
        ctl_args_free(&args);
        if (fflush(stdout) != 0 && rc == 0)
                rc = 1;
        return rc;
}
