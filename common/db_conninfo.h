/* db_conninfo.h - OUTBOX_DATABASE_URL as libpq reads it: checked before
 * anything connects, and shown without its secrets. Part of the db module
 * (the only one that includes libpq); this header does not include it. */
#ifndef OUTBOX_DB_CONNINFO_H
#define OUTBOX_DB_CONNINFO_H

#include <stddef.h>

/* Checks `conninfo` (a keyword/value string, a postgresql:// URI, or a bare
 * database name, as PQconnectdbParams with expand_dbname takes it): libpq's
 * own PQconninfoParse for the syntax and the keywords, then the values libpq
 * refuses only when it connects (sslmode, gssencmode, channel_binding,
 * target_session_attrs, ssl_{min,max}_protocol_version, ports and the other
 * integers, hostaddr, the host/hostaddr/port counts). 0, or -1 with one line
 * in errstr that holds no value of the string: libpq's message is copied only
 * with its quoted parts elided, since it can quote the password. */
int db_conninfo_check(const char *conninfo, char *errstr, size_t errstr_size)
        __attribute__((warn_unused_result));

/* Writes the options libpq parses from `conninfo` as a keyword/value string
 * (in libpq's keyword order, values quoted where needed), with the value of
 * every secret option (password, sslpassword) written as ****; a string
 * libpq refuses is written as "(not a valid connection string)". */
void db_conninfo_redact(const char *conninfo, char *out, size_t out_size);

/* Replaces, in the NUL-terminated `text`, every occurrence of the value of a
 * secret option of `conninfo` with ****, shortening text in place. For
 * messages libpq builds while connecting, should one quote a secret. */
void db_conninfo_scrub(const char *conninfo, char *text);

#endif
