/* db_migrate.c - applying the schema migrations (outboxctl migrate;
 * docs/DESIGN.md, "outboxctl migrate").
 *
 * The migrations name the table unqualified (outbox_event), so they are
 * applied with search_path set to the one schema the table lives in (or will
 * be created in). What was applied is recorded in outbox_schema_migrations,
 * in the same schema, one row per migration, in the migration's own
 * transaction. A session advisory lock keeps two migrating sessions of a
 * database apart. */
#include "db_admin.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "db_conninfo.h"
#include "db_internal.h"
#include "db_version.h"
#include "errstr.h"
#include "log.h"

/* The advisory lock every `outboxctl migrate` of a database takes: the
 * bytes of "outboxmg" as a bigint. */
#define MIGRATE_LOCK_KEY "8031453476610927975"

/* The record of applied migrations, created in the table's schema. */
#define RECORD_TABLE "outbox_schema_migrations"
static const char record_ddl[] =
        "CREATE TABLE " RECORD_TABLE " (version int PRIMARY KEY, name text NOT NULL,"
        " applied_at timestamptz NOT NULL DEFAULT now());"
        "COMMENT ON TABLE " RECORD_TABLE " IS 'schema migrations (schemas/postgres/NNN_*.sql)"
        " applied by outboxctl migrate'";

/* As the other connections (db.c): a half-dead connection fails within
 * about a minute. */
static const char *const conn_keys[] = {
        "application_name", "connect_timeout",  "keepalives_idle", "keepalives_interval",
        "keepalives_count", "tcp_user_timeout", "dbname",          NULL};

/* The server's NOTICEs and WARNINGs while migrating, as log lines. */
static void on_notice(void *arg, const PGresult *res) {
        (void)arg;
        const char *sev = PQresultErrorField(res, PG_DIAG_SEVERITY_NONLOCALIZED);
        char text[512];
        snprintf(text, sizeof text, "%s", PQresultErrorMessage(res));
        text[strcspn(text, "\n")] = '\0';
        if (sev && (!strcmp(sev, "NOTICE") || !strcmp(sev, "INFO") || !strcmp(sev, "LOG") ||
                    !strcmp(sev, "DEBUG")))
                log_info("migrate", "server message", "text=%s", text);
        else
                log_warn("migrate", "server message", "text=%s", text);
}

/* Runs sql with up to 2 text parameters and copies the first cell of its one
 * row (or "" when NULL) into out. */
static int query_value(struct db *db, const char *sql, int n, const char *p1, const char *p2,
                       char *out, size_t out_size, char *errstr, size_t size) {
        const char *params[2] = {p1, p2};
        PGresult *r = PQexecParams(db->conn, sql, n, NULL, params, NULL, NULL, 0);
        int rc = 0;
        if (PQresultStatus(r) != PGRES_TUPLES_OK || PQntuples(r) != 1 || PQnfields(r) < 1)
                rc = errstr_set(errstr, size, "%s", PQerrorMessage(db->conn));
        else
                snprintf(out, out_size, "%s", PQgetisnull(r, 0, 0) ? "" : PQgetvalue(r, 0, 0));
        PQclear(r);
        return rc;
}

int db_migrate_connect(struct db *db, char *schema, size_t schema_size, char *errstr,
                       size_t errstr_size) {
        const char *vals[] = {"outboxctl", "10", "30", "10", "3", "60000", db->url, NULL};
        char want[128] = "", found[128] = "", set[300];
        const char *dot = strchr(db->table, '.');

        db_disconnect(db);
        db->conn = PQconnectdbParams(conn_keys, vals, 1);
        if (!db->conn)
                return errstr_set(errstr, errstr_size, "out of memory");
        if (PQstatus(db->conn) != CONNECTION_OK) {
                errstr_set(errstr, errstr_size, "connect: %s", PQerrorMessage(db->conn));
                db_conninfo_scrub(db->url, errstr);
                db_disconnect(db);
                return -1;
        }
        int refused = db_check_server_version(PQserverVersion(db->conn), errstr, errstr_size);
        if (refused) {
                db_disconnect(db);
                return refused;
        }
        PQsetNoticeReceiver(db->conn, on_notice, db);
        /* The schema named in OUTBOX_TABLE (as PostgreSQL folds an unquoted
         * name); else the schema of the table search_path finds; else the
         * one it would be created in (the first of search_path that exists). */
        if (dot) {
                snprintf(want, sizeof want, "%.*s", (int)(dot - db->table), db->table);
                if (query_value(
                            db,
                            "SELECT (SELECT nspname FROM pg_namespace WHERE nspname = lower($1))",
                            1, want, NULL, found, sizeof found, errstr, errstr_size))
                        goto fail;
                if (!*found) {
                        errstr_set(errstr, errstr_size,
                                   "schema %s does not exist (create it first, or name another "
                                   "in OUTBOX_TABLE)",
                                   want);
                        goto fail;
                }
        } else {
                if (query_value(db,
                                "SELECT coalesce((SELECT n.nspname FROM pg_class c JOIN"
                                " pg_namespace n ON n.oid = c.relnamespace"
                                " WHERE c.oid = to_regclass($1)), current_schema())",
                                1, db->table, NULL, found, sizeof found, errstr, errstr_size))
                        goto fail;
                if (!*found) {
                        errstr_set(errstr, errstr_size,
                                   "search_path names no schema that exists: name one in "
                                   "OUTBOX_TABLE (schema.outbox_event)");
                        goto fail;
                }
        }
        char *q = PQescapeIdentifier(db->conn, found, strlen(found));
        if (!q) {
                errstr_set(errstr, errstr_size, "out of memory");
                goto fail;
        }
        snprintf(set, sizeof set, "SET search_path = %s", q);
        PQfreemem(q);
        if (db_exec_simple(db, set, errstr, errstr_size))
                goto fail;
        snprintf(schema, schema_size, "%s", found);
        return 0;
fail:
        db_disconnect(db);
        return -1;
}

int db_migrate_lock(struct db *db, int wait_s, char *errstr, size_t errstr_size) {
        char got[8], sql[64];
        if (query_value(db, "SELECT pg_try_advisory_lock(" MIGRATE_LOCK_KEY ")", 0, NULL, NULL, got,
                        sizeof got, errstr, errstr_size))
                return -1;
        if (!strcmp(got, "t"))
                return 0;
        log_info("migrate", "another outboxctl migrate holds the lock: waiting", "wait_s=%d",
                 wait_s);
        snprintf(sql, sizeof sql, "SET lock_timeout = '%ds'", wait_s);
        if (db_exec_simple(db, sql, errstr, errstr_size))
                return -1;
        int rc = query_value(db, "SELECT pg_advisory_lock(" MIGRATE_LOCK_KEY ")::text", 0, NULL,
                             NULL, got, sizeof got, errstr, errstr_size);
        if (rc != 0)
                errstr_set(errstr, errstr_size,
                           "another outboxctl migrate held the advisory lock for more than %d s",
                           wait_s);
        char reset_err[256];
        if (db_exec_simple(db, "RESET lock_timeout", reset_err, sizeof reset_err) && rc == 0)
                rc = errstr_set(errstr, errstr_size, "%s", reset_err);
        return rc;
}

int db_migrate_level(struct db *db, int *level, int *recorded, int *table_exists, char *errstr,
                     size_t errstr_size) {
        char v[32];
        *level = 0;
        *recorded = *table_exists = 0;
        if (query_value(db, "SELECT to_regclass('outbox_event') IS NOT NULL", 0, NULL, NULL, v,
                        sizeof v, errstr, errstr_size))
                return -1;
        *table_exists = !strcmp(v, "t");
        if (query_value(db, "SELECT to_regclass('" RECORD_TABLE "') IS NOT NULL", 0, NULL, NULL, v,
                        sizeof v, errstr, errstr_size))
                return -1;
        *recorded = !strcmp(v, "t");
        if (!*recorded)
                return 0;
        if (query_value(db, "SELECT coalesce(max(version), 0) FROM " RECORD_TABLE, 0, NULL, NULL, v,
                        sizeof v, errstr, errstr_size))
                return -1;
        *level = atoi(v);
        return 0;
}

int db_migrate_recorded(struct db *db, int version, int *yes, char *errstr, size_t errstr_size) {
        char ver[16], v[8];
        *yes = 0;
        snprintf(ver, sizeof ver, "%d", version);
        if (query_value(db, "SELECT to_regclass('" RECORD_TABLE "') IS NOT NULL", 0, NULL, NULL, v,
                        sizeof v, errstr, errstr_size))
                return -1;
        if (strcmp(v, "t") != 0)
                return 0;
        if (query_value(db,
                        "SELECT EXISTS (SELECT 1 FROM " RECORD_TABLE " WHERE version = $1::int)", 1,
                        ver, NULL, v, sizeof v, errstr, errstr_size))
                return -1;
        *yes = !strcmp(v, "t");
        return 0;
}

void db_migrate_holders(struct db *db, char *out, size_t out_size) {
        char err[256];
        /* the sessions of this database with a lock granted on the table,
         * and prepared transactions holding one; those whose details this
         * role may not read (NULL start) first, then the longest
         * transaction; of their statement its first words only */
        static const char sql[] =
                "WITH l AS (SELECT pid, virtualtransaction FROM pg_locks"
                " WHERE locktype = 'relation' AND granted"
                "  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
                "  AND relation = to_regclass('outbox_event'))"
                " SELECT coalesce(string_agg(h, '; ' ORDER BY o NULLS FIRST), '') FROM ("
                " SELECT format('pid=%s application=%s state=%s xact_age_s=%s command=%s',"
                "  a.pid, a.application_name, coalesce(a.state, 'unknown'),"
                "  coalesce(extract(epoch FROM now() - a.xact_start)::bigint::text, 'unknown'),"
                "  coalesce(substring(a.query FROM"
                "   '^[[:space:]]*([A-Za-z]+([[:space:]]+[A-Za-z]+)?)'), '')) AS h,"
                "  a.xact_start AS o"
                " FROM pg_stat_activity a"
                " WHERE a.pid <> pg_backend_pid() AND a.pid IN (SELECT pid FROM l)"
                " UNION ALL"
                " SELECT format('prepared transaction gid=%s prepared_s=%s', p.gid,"
                "  extract(epoch FROM now() - p.prepared)::bigint), p.prepared"
                " FROM pg_prepared_xacts p"
                " WHERE '-1/' || p.transaction IN (SELECT virtualtransaction FROM l)"
                " ORDER BY 2 NULLS FIRST LIMIT 5) s";
        if (query_value(db, sql, 0, NULL, NULL, out, out_size, err, sizeof err) != 0)
                snprintf(out, out_size, "unknown (%s)", err);
}

/* Rolls back the transaction the connection is in, if any, so that the
 * session can go on (this connection is not the async one: no phase). */
static void rollback(struct db *db) {
        if (db->conn && PQstatus(db->conn) == CONNECTION_OK &&
            PQtransactionStatus(db->conn) != PQTRANS_IDLE) {
                PGresult *r = PQexec(db->conn, "ROLLBACK");
                PQclear(r);
        }
}

int db_migrate_apply(struct db *db, const struct db_migration *m, char *errstr,
                     size_t errstr_size) {
        char ver[16], v[8];
        int rc = -1;
        snprintf(ver, sizeof ver, "%d", m->version);
        if (db_exec_simple(db, "BEGIN", errstr, errstr_size))
                return -1;
        if (query_value(db, "SELECT to_regclass('" RECORD_TABLE "') IS NOT NULL", 0, NULL, NULL, v,
                        sizeof v, errstr, errstr_size))
                goto fail;
        if (strcmp(v, "t") != 0 && db_exec_simple(db, record_ddl, errstr, errstr_size))
                goto fail;
        PGresult *r = PQexec(db->conn, m->sql);
        ExecStatusType st = PQresultStatus(r);
        const char *state = r ? PQresultErrorField(r, PG_DIAG_SQLSTATE) : NULL;
        int lock_timeout = state && !strcmp(state, "55P03");
        PQclear(r);
        if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK) {
                errstr_set(errstr, errstr_size, "%s: %s", m->name, PQerrorMessage(db->conn));
                if (lock_timeout)
                        rc = DB_ERR_LOCK_TIMEOUT;
                goto fail;
        }
        if (query_value(db,
                        "INSERT INTO " RECORD_TABLE " (version, name) VALUES ($1::int, $2)"
                        " ON CONFLICT (version) DO UPDATE SET name = excluded.name,"
                        " applied_at = now() RETURNING version",
                        2, ver, m->name, v, sizeof v, errstr, errstr_size))
                goto fail;
        if (db_exec_simple(db, "COMMIT", errstr, errstr_size))
                goto fail;
        return 0;
fail:
        rollback(db);
        db_check_conn(db);
        return rc;
}
