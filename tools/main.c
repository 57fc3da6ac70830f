/* outboxctl: operator commands for the outbox table and its topics
 * (docs/DESIGN.md, "outboxctl"). Reads the environment only. */
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "config.h"
#include "ctl.h"
#include "ctl_args.h"
#include "db_admin.h"
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
               "replay: rows refused;\nrelease-gap: no gap; migrate: the database's schema is "
               "newer) or a runtime error,\n2 usage, bad configuration or a server too old, 3 "
               "reconcile cannot tell\n(partitions it could not read: rows not found may be "
               "there).\n");
}

/* A usage error: one plain line (not a log line), naming what is wrong and
 * where the usage is. */
static void usage_error(const struct ctl_args *a, const char *err) {
        char line[1024];
        snprintf(line, sizeof line, "outboxctl: %s (see outboxctl%s%s --help)", err,
                 a->cmd != CTL_NONE ? " " : "", a->cmd != CTL_NONE ? ctl_command_name(a->cmd) : "");
        log_plain(line);
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
        case CTL_MIGRATE: return ctl_migrate(c);
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
        if (ctl_args_parse(&args, argc, argv, ctl_now_ms(), err, sizeof err) != 0) {
                usage_error(&args, err);
                goto out;
        }
        if (args.version || args.help) {
                if (args.version)
                        printf("outboxctl %s\n", OUTBOX_VERSION);
                else if (args.cmd == CTL_NONE)
                        print_help();
                else
                        ctl_usage(stdout, args.cmd);
                rc = 0;
                goto out;
        }
        log_setup(LOG_INFO, config_log_json_hint(CONFIG_CTL, 1, env_only));
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
        /* migrate connects by itself: the table need not exist yet */
        int connected = args.cmd == CTL_MIGRATE ? 0 : db_connect(db, err, sizeof err);
        if (connected == DB_ERR_SERVER_VERSION) {
                log_error("db", "database server not supported", "err=%s", err);
                rc = 2;
                goto out;
        }
        if (connected != 0) {
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
