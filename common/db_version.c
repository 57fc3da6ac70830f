/* db_version.c - the oldest PostgreSQL server the programs run against. The
 * statements rely on features of that major (docs/DESIGN.md, "Supported
 * versions"); an older server is refused at connect, not left to fail
 * statement by statement. */
#include "db_version.h"

#include "db.h"
#include "errstr.h"

#ifndef OUTBOX_PG_MIN_MAJOR
#error "OUTBOX_PG_MIN_MAJOR (deploy/versions' PG_MIN_MAJOR) must be defined by the build"
#endif

int db_check_server_version(long version, char *errstr, size_t errstr_size) {
        int v = version > 0 && version < 100000000 ? (int)version : 0;
        if (v >= OUTBOX_PG_MIN_MAJOR * 10000)
                return 0;
        if (v >= 100000)
                errstr_set(errstr, errstr_size, "PostgreSQL server %d.%d: %d or newer needed",
                           v / 10000, v % 10000, OUTBOX_PG_MIN_MAJOR);
        else if (v > 0)
                errstr_set(errstr, errstr_size, "PostgreSQL server %d.%d.%d: %d or newer needed",
                           v / 10000, v / 100 % 100, v % 100, OUTBOX_PG_MIN_MAJOR);
        else
                errstr_set(errstr, errstr_size,
                           "PostgreSQL server of unknown version: %d or newer needed",
                           OUTBOX_PG_MIN_MAJOR);
        return DB_ERR_SERVER_VERSION;
}
