/* ctl_migrate.c - outboxctl migrate: applies the schema migrations built
 * into the program (schemas/postgres/NNN_name.sql) that the database has not
 * recorded (docs/DESIGN.md, "outboxctl migrate"). */
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "ctl.h"
#include "encode.h"
#include "log.h"
#include "migrations.h"

/* How long a migrate waits for another one holding the advisory lock. */
#define MIGRATE_LOCK_WAIT_S 600

/* A migration that locks the table gives up after its lock_timeout (5 s)
 * rather than hold the application's writes queued behind it; one that
 * gave up (a relay's statement held the table, up to its statement
 * timeout) is tried again, this many times in all, this far apart. */
#define MIGRATE_TRIES       6
#define MIGRATE_TRY_PAUSE_S 2

/* The migrations are written for a table named outbox_event (its indexes,
 * constraints, trigger and function are named after it). */
#define MIGRATE_TABLE "outbox_event"

/* The one JSON object of --json. `names` lists the migrations applied (or
 * that would be). */
static int print_json(const char *schema, int dry_run, int before, int after,
                      const char *const *names, size_t n) {
        struct buf b = {0};
        int rc = buf_appendf(&b, "{\"schema\": ");
        rc = rc ? rc : buf_append_json_string(&b, schema);
        rc = rc ? rc
                : buf_appendf(&b,
                              ", \"table\": \"" MIGRATE_TABLE "\", \"dry_run\": %s, "
                              "\"level_before\": %d, \"level\": %d, \"known_level\": %d, "
                              "\"migrations\": [",
                              dry_run ? "true" : "false", before, after,
                              migrations[MIGRATIONS_COUNT - 1].version);
        for (size_t i = 0; rc == 0 && i < n; i++) {
                rc = i ? buf_append(&b, ", ", 2) : 0;
                rc = rc ? rc : buf_append_json_string(&b, names[i]);
        }
        rc = rc ? rc : buf_appendf(&b, "]}\n");
        if (rc == 0)
                fwrite(b.data, 1, b.len, stdout);
        buf_free(&b);
        return rc;
}

int ctl_migrate(struct ctl *c) {
        const struct ctl_args *a = c->args;
        const char *dot = strchr(c->cfg->table, '.');
        const char *name = dot ? dot + 1 : c->cfg->table;
        const char *todo[MIGRATIONS_COUNT];
        size_t ntodo = 0;
        char schema[128] = "", err[512], holders[1024];
        int level, recorded, exists;
        int known = migrations[MIGRATIONS_COUNT - 1].version;

        if (strcasecmp(name, MIGRATE_TABLE) != 0) {
                log_error("config", "bad configuration", "err=%s%s%s",
                          "OUTBOX_TABLE: migrate creates a table named " MIGRATE_TABLE
                          " (in any schema: schema." MIGRATE_TABLE "), not ",
                          name, "; apply schemas/postgres by hand for another name");
                return 2;
        }
        int connected = db_migrate_connect(c->db, schema, sizeof schema, err, sizeof err);
        if (connected == DB_ERR_SERVER_VERSION) {
                log_error("db", "database server not supported", "err=%s", err);
                return 2;
        }
        if (connected != 0) {
                log_error("migrate", "migrate failed", "err=%s", err);
                return 1;
        }
        if (!a->dry_run && db_migrate_lock(c->db, MIGRATE_LOCK_WAIT_S, err, sizeof err) != 0)
                goto fail;
        /* read under the lock: another migrate may have just finished */
        if (db_migrate_level(c->db, &level, &recorded, &exists, err, sizeof err) != 0)
                goto fail;
        if (level > known) {
                log_error("migrate", "the database has a newer schema than this program knows",
                          "schema=%s level=%d known_level=%d", schema, level, known);
                return 1;
        }
        int before = level;
        for (size_t i = 0; i < MIGRATIONS_COUNT; i++) {
                const struct db_migration *m = &migrations[i];
                int done = 0;
                if (db_migrate_recorded(c->db, m->version, &done, err, sizeof err) != 0)
                        goto fail;
                if (done)
                        continue;
                todo[ntodo++] = m->name;
                if (a->dry_run)
                        continue;
                int rc = db_migrate_apply(c->db, m, err, sizeof err);
                for (int try = 2; rc == DB_ERR_LOCK_TIMEOUT && try <= MIGRATE_TRIES; try++) {
                        db_migrate_holders(c->db, holders, sizeof holders);
                        log_warn("migrate", "lock wait timed out, retrying",
                                 "schema=%s migration=%s try=%d of=%d err=%s held_by=%s", schema,
                                 m->name, try, MIGRATE_TRIES, err, holders);
                        struct timespec pause = {MIGRATE_TRY_PAUSE_S, 0};
                        nanosleep(&pause, NULL);
                        rc = db_migrate_apply(c->db, m, err, sizeof err);
                }
                if (rc == DB_ERR_LOCK_TIMEOUT) {
                        db_migrate_holders(c->db, holders, sizeof holders);
                        log_error("migrate", "migrate failed: the table stayed locked",
                                  "schema=%s migration=%s tries=%d err=%s held_by=%s", schema,
                                  m->name, MIGRATE_TRIES, err, holders);
                        return 1;
                }
                if (rc != 0)
                        goto fail;
                log_info("migrate", "applied", "schema=%s migration=%s", schema, m->name);
                if (!a->json)
                        printf("applied %s\n", m->name);
                if (m->version > level)
                        level = m->version;
        }
        int after = a->dry_run && ntodo ? known : level;
        if (a->json) {
                if (print_json(schema, a->dry_run, before, after, todo, ntodo) != 0) {
                        snprintf(err, sizeof err, "out of memory");
                        goto fail;
                }
        } else if (a->dry_run) {
                for (size_t i = 0; i < ntodo; i++)
                        printf("would apply %s\n", todo[i]);
                printf("schema %s: level %d%s; this program knows %d (dry run: nothing "
                       "changed)\n",
                       schema, before,
                       recorded ? ""
                       : exists ? " (no migrations recorded; the table exists)"
                                : " (no table)",
                       known);
        } else {
                printf("schema %s: level %d%s\n", schema, after,
                       ntodo ? "" : " (nothing to apply)");
        }
        return 0;
fail:
        log_error("migrate", "migrate failed", "schema=%s err=%s", schema, err);
        return 1;
}
