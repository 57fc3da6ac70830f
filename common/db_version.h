/* db_version.h - the PostgreSQL servers the programs accept. */
#ifndef OUTBOX_DB_VERSION_H
#define OUTBOX_DB_VERSION_H

#include <stddef.h>

/* 0 when a server of server_version_num `version` (e.g. 170006 for 17.6,
 * 90624 for 9.6.24; 0 unknown) is PostgreSQL OUTBOX_PG_MIN_MAJOR
 * (deploy/versions) or newer. Otherwise DB_ERR_SERVER_VERSION (db.h) with
 * errstr naming the server's version and the oldest supported major. */
int db_check_server_version(long version, char *errstr, size_t errstr_size)
        __attribute__((warn_unused_result));

#endif
