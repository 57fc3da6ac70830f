/* outbox-relay: publishes PostgreSQL outbox rows to Kafka (DESIGN.md). */
#include "kafka.h"
#include "lifecycle.h"
#include "log.h"
#include "relay.h"

int main(int argc, char **argv) {
        struct lifecycle lc;
        struct relay *relay = NULL;
        char err[512];

        int rc = lifecycle_start(&lc, CONFIG_RELAY, argc, argv, kafka_conf_check);
        if (rc < 0) {
                relay = relay_new(&lc.cfg, lc.http, err, sizeof err);
                if (relay)
                        rc = relay_run(relay, lc.stop);
                else
                        log_error("relay", "cannot start", "err=%s", log_quote(err));
                rc = relay ? rc : 1;
        }
        relay_destroy(relay);
        lifecycle_finish(&lc);
        return rc;
}
