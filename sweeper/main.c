/* outbox-sweeper: returns stale PUBLISHING locks and deletes PUBLISHED rows
 * past retention (docs/DESIGN.md). */
#include "lifecycle.h"
#include "log.h"
#include "sweeper.h"

int main(int argc, char **argv) {
        struct lifecycle lc;
        struct sweeper *sweeper = NULL;
        char err[512];

        int rc = lifecycle_start(&lc, CONFIG_SWEEPER, argc, argv, NULL);
        if (rc < 0) {
                /* a delete loop may run long between heartbeats on a slow table */
                if (lc.http)
                        http_set_stall(lc.http, 300);
                sweeper = sweeper_new(&lc.cfg, lc.http, err, sizeof err);
                if (sweeper)
                        rc = sweeper_run(sweeper, lc.stop);
                else
                        log_error("sweeper", "cannot start", "err=%s", err);
                rc = sweeper ? rc : 1;
        }
        if (lifecycle_refused())
                rc = 2;
        sweeper_destroy(sweeper);
        lifecycle_finish(&lc);
        return rc;
}
