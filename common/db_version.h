/* db_version.h - the PostgreSQL servers the programs accept. A db file's
 * header (it takes a libpq connection): include it only from common/db*.c. */
#ifndef OUTBOX_DB_VERSION_H
#define OUTBOX_DB_VERSION_H

#include <libpq-fe.h>
#include <stddef.h>

/* 0 when conn's server is PostgreSQL OUTBOX_PG_MIN_MAJOR (deploy/versions) or
 * newer. Otherwise DB_ERR_SERVER_VERSION (db.h) with errstr naming the
 * server's version and the oldest supported major. */
int db_check_server_version(PGconn *conn, char *errstr, size_t errstr_size)
        __attribute__((warn_unused_result));

#endif
