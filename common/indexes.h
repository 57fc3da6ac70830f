/* indexes.h - what the index check (common/sql/indexes.sql) found, as log
 * lines: the relay and the sweeper run the check on their own connections
 * and report its findings the same way. */
#ifndef OUTBOX_INDEXES_H
#define OUTBOX_INDEXES_H

struct db_result;

/* One log line per finding of an indexes.sql answer (name, file, finding),
 * under module `mod`: warn where a statement reads far more of the table
 * than it needs, info where nothing is lost yet (a build under way, the old
 * guard index nothing reads). */
void indexes_log(const char *mod, const struct db_result *res);

#endif
