/* indexes.c - the index check's findings as log lines. */
#include "indexes.h"

#include <string.h>

#include "db_async.h"
#include "log.h"

void indexes_log(const char *mod, const struct db_result *res) {
        for (int i = 0; i < db_result_rows(res); i++) {
                const char *name = db_result_value(res, i, 0);
                const char *file = db_result_value(res, i, 1);
                const char *finding = db_result_value(res, i, 2);
                if (!strcmp(finding, "unused"))
                        log_info(mod,
                                 "old guard index on the table: no relay of this version reads it;"
                                 " once every relay is upgraded, drop it (DROP INDEX CONCURRENTLY)",
                                 "index=%s", name);
                else if (!strcmp(finding, "old_invalid"))
                        log_warn(mod,
                                 "old guard index on the table is not valid: relays of earlier"
                                 " versions (a rolling upgrade, a rollback) probe it; build it"
                                 " again while such relays run, else drop it",
                                 "index=%s", name);
                else if (!strcmp(finding, "in_use"))
                        log_warn(mod,
                                 "old guard index on the table, read in place of a guard index"
                                 " missing or not valid: keep it until both are built",
                                 "index=%s file=schemas/postgres/%s", name, file);
                else if (!strcmp(finding, "different"))
                        log_warn(mod,
                                 "index differs from its definition: the statements written for it"
                                 " read far more of the table than they need; build it again as"
                                 " the file defines it",
                                 "index=%s file=schemas/postgres/%s", name, file);
                else if (!strcmp(finding, "building"))
                        log_info(mod,
                                 "index being built (CREATE INDEX CONCURRENTLY): until it is valid,"
                                 " the statements written for it read far more of the table",
                                 "index=%s", name);
                else if (!strcmp(finding, "missing"))
                        log_warn(mod,
                                 "index missing: the statements written for it read far more of"
                                 " the table than they need; build it as the file defines it"
                                 " (CREATE INDEX CONCURRENTLY)",
                                 "index=%s file=schemas/postgres/%s", name, file);
                else
                        log_warn(mod,
                                 "index invalid (a CREATE INDEX CONCURRENTLY that failed, or one"
                                 " still running that this role cannot see): the statements"
                                 " written for it read far more of the table than they need; once"
                                 " no build runs, drop it and build it again as the file defines"
                                 " it",
                                 "index=%s file=schemas/postgres/%s", name, file);
        }
}
