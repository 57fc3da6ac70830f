/* outbox-relay: publishes PostgreSQL outbox rows to Kafka (docs/DESIGN.md). */
#include <malloc.h>

#include "kafka.h"
#include "lifecycle.h"
#include "log.h"
#include "relay.h"
#include "zstd_reuse.h"

int main(int argc, char **argv) {
        struct lifecycle lc;
        struct relay *relay = NULL;
        char err[512];

        /* No fastbins: a batch frees thousands of small blocks at once (the
         * messages' headers, after their delivery reports), and the next
         * large allocation (a libpq result) would make glibc consolidate
         * them all, every batch. Without fastbins the frees coalesce as they
         * come. A failure only leaves glibc's default. */
        (void)mallopt(M_MXFAST, 0);
        zstd_reuse_init();

        int rc = lifecycle_start(&lc, CONFIG_RELAY, argc, argv, kafka_conf_check);
        if (rc < 0) {
                relay = relay_new(&lc.cfg, lc.http, err, sizeof err);
                if (relay)
                        rc = relay_run(relay, lc.stop, lifecycle_wake_fd());
                else
                        log_error("relay", "cannot start", "err=%s", err);
                rc = relay ? rc : 1;
        }
        if (lifecycle_refused())
                rc = 2;
        relay_destroy(relay);
        lifecycle_finish(&lc);
        return rc;
}
