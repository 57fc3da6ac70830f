/* config.c - one declarative table of settings (as pgbouncer's CF_ABS), read
 * from defaults, a key = value file, the environment and flags. */
#include "config.h"

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "db_conninfo.h"
#include "encode.h"
#include "errstr.h"
#include "log.h"

extern char **environ;

enum opt_type { T_STR, T_INT, T_LL, T_ENUM };

static const char *const ordering_names[] = {"aggregate", "none", "increasing", NULL};
static const char *const value_format_names[] = {"envelope", "payload", NULL};
static const char *const serialization_names[] = {"json", "avro", NULL};
static const char *const log_level_names[] = {"debug", "info", "warn", "error", NULL};
static const char *const log_format_names[] = {"text", "json", NULL};
static const char *const bool_names[] = {"false", "true", NULL};

#define BOTH    (CONFIG_RELAY | CONFIG_SWEEPER)
#define RELAY   CONFIG_RELAY
#define SWEEPER CONFIG_SWEEPER
#define CTL     CONFIG_CTL
#define ALL     (BOTH | CTL)

/* 100 years: PostgreSQL's timestamps end in 4713 BC, so a retention much
 * longer than recorded history makes the sweeper's `now() - retention` fail
 * ("timestamp out of range") on every sweep. */
#define RETENTION_MAX_S 3155760000LL
/* Longest OUTBOX_RELAY_ID and OUTBOX_PRODUCER_NAME: written into every row's
 * locked_by, every message's producer header and log lines. */
#define NAME_MAX_BYTES 200

struct opt {
        const char *env; /* OUTBOX_BATCH_SIZE; file key and flag derive from it */
        enum opt_type type;
        const char *def; /* NULL: required (strings) */
        size_t off;
        int programs;
        long long min, max;
        const char *const *choices;
        const char *help;
};

#define O(f) offsetof(struct config, f)
static const struct opt opts[] = {
        {"OUTBOX_DATABASE_URL", T_STR, NULL, O(database_url), ALL, 0, 0, NULL,
         "libpq connection string or URI (required)"},
        {"OUTBOX_TABLE", T_STR, "outbox_event", O(table), ALL, 0, 0, NULL,
         "outbox table, optionally schema-qualified"},
        {"OUTBOX_RELAY_ID", T_STR, "", O(relay_id), BOTH, 0, 0, NULL,
         "written to locked_by (default hostname-pid)"},
        {"OUTBOX_BATCH_SIZE", T_INT, "500", O(batch_size), RELAY, 1, 100000, NULL,
         "rows locked per batch"},
        {"OUTBOX_BATCH_BYTES", T_LL, "16777216", O(batch_bytes), RELAY, 65536, 1073741824, NULL,
         "bytes of row content (payloads, headers, other text) a relay holds fetched and not "
         "yet produced; one row always goes, however large"},
        {"OUTBOX_POLL_INTERVAL_MS", T_INT, "200", O(poll_interval_ms), RELAY, 1, 3600000, NULL,
         "longest idle wait; NOTIFY wakes sooner"},
        {"OUTBOX_ORDERING", T_ENUM, "aggregate", O(ordering), BOTH, 0, 0, ordering_names,
         "aggregate (consecutive versions per aggregate, gaps held), increasing (versions "
         "only increase) or none; read by the sweeper too"},
        {"OUTBOX_MAX_ATTEMPTS", T_INT, "10", O(max_attempts), BOTH, 1, 1000000, NULL,
         "attempts before a row goes DEAD (the sweeper's stale-lock reset too)"},
        {"OUTBOX_BACKOFF_INITIAL_MS", T_INT, "1000", O(backoff_initial_ms), RELAY, 1, INT_MAX, NULL,
         "first retry delay"},
        {"OUTBOX_BACKOFF_MAX_MS", T_INT, "300000", O(backoff_max_ms), RELAY, 1, INT_MAX, NULL,
         "longest retry delay"},
        {"OUTBOX_TOPIC_TEMPLATE", T_STR, "outbox.event.{aggregate_type}", O(topic_template),
         RELAY | CTL, 0, 0, NULL,
         "topic when topic_name is NULL: {aggregate_type} {event_type} {tenant_id}"},
        {"OUTBOX_VALUE_FORMAT", T_ENUM, "envelope", O(value_format), RELAY, 0, 0,
         value_format_names, "envelope or payload"},
        {"OUTBOX_SERIALIZATION", T_ENUM, "json", O(serialization), RELAY, 0, 0, serialization_names,
         "json or avro"},
        {"OUTBOX_SCHEMA_REGISTRY_URL", T_STR, "", O(schema_registry_url), RELAY, 0, 0, NULL,
         "Confluent schema registry for avro (optional)"},
        {"OUTBOX_SCHEMA_REGISTRY_AUTO_REGISTER", T_ENUM, "true", O(schema_registry_auto_register),
         RELAY, 0, 0, bool_names,
         "true: register the value schema under <topic>-value; false: only look it up"},
        {"OUTBOX_ENVELOPE_FIELDS", T_STR, "", O(envelope_fields), RELAY, 0, 0, NULL,
         "extra envelope fields: event_key, partition_key, topic_name, "
         "headers_json.<member>[:name],..."},
        {"OUTBOX_PRODUCER_NAME", T_STR, "outbox-relay", O(producer_name), RELAY, 0, 0, NULL,
         "value of the producer header"},
        {"OUTBOX_HTTP_ADDR", T_STR, "0.0.0.0:9464", O(http_addr), BOTH, 0, 0, NULL,
         "host:port for /metrics /healthz /readyz, or off"},
        {"OUTBOX_LOG_LEVEL", T_ENUM, "info", O(log_level), ALL, 0, 0, log_level_names,
         "debug, info, warn or error"},
        {"OUTBOX_LOG_FORMAT", T_ENUM, "json", O(log_format_json), ALL, 0, 0, log_format_names,
         "json or text (outboxctl: text by default)"},
        {"OUTBOX_STATEMENT_TIMEOUT_MS", T_INT, "10000", O(statement_timeout_ms), BOTH, 100, 3600000,
         NULL,
         "statement_timeout of the daemons' sessions; a relay that completes no lock and no "
         "mark for 2 x OUTBOX_POLL_INTERVAL_MS + this is stalled (/readyz 503)"},
        {"OUTBOX_DB_LOCK_TIMEOUT_MS", T_INT, "2000", O(db_lock_timeout_ms), BOTH, 10, 3600000, NULL,
         "lock_timeout of the daemons' sessions: the longest any of their statements waits "
         "behind DDL or maintenance (the wait is logged with its blocker)"},
        {"OUTBOX_LOCK_TIMEOUT_S", T_INT, "300", O(lock_timeout_s), BOTH, 1, INT_MAX, NULL,
         "a PUBLISHING lock older than this is stale (the relay checks its delivery "
         "timeout against it)"},
        {"OUTBOX_SWEEP_INTERVAL_S", T_INT, "30", O(sweep_interval_s), SWEEPER, 1, 86400, NULL,
         "sweeper loop period"},
        {"OUTBOX_RETENTION_S", T_LL, "2592000", O(retention_s), SWEEPER, 0, RETENTION_MAX_S, NULL,
         "delete PUBLISHED rows older than this; 0 keeps all"},
        {"OUTBOX_RETENTION_KEEP_LATEST", T_ENUM, "false", O(retention_keep_latest), SWEEPER, 0, 0,
         bool_names,
         "true: keep each aggregate's latest published row past retention, so a gap after it "
         "is still seen (OUTBOX_ORDERING=aggregate; one row per aggregate, kept)"},
        {"OUTBOX_DELETE_BATCH", T_INT, "1000", O(delete_batch), SWEEPER, 1, 1000000, NULL,
         "rows per stale-lock and retention statement (10 x for parking)"},
#ifdef OUTBOX_TEST_HOOKS
        {"OUTBOX_TEST_LOCK_DELAY_MS", T_INT, "0", O(test_lock_delay_ms), RELAY, 0, 3600000, NULL,
         "test hook: every lock statement pauses this long before its row locks"},
        {"OUTBOX_TEST_SAMPLE_DELAY_MS", T_INT, "0", O(test_sample_delay_ms), RELAY, 0, 3600000,
         NULL, "test hook: every table sample takes this much longer"},
        {"OUTBOX_TEST_MARK_DELAY_MS", T_INT, "0", O(test_mark_delay_ms), RELAY, 0, 3600000, NULL,
         "test hook: every mark statement pauses this long before it changes rows"},
        {"OUTBOX_TEST_REPLAY_PAUSE_MS", T_INT, "0", O(test_replay_pause_ms), CTL, 0, 3600000, NULL,
         "test hook: outboxctl replay pauses this long between a step's two halves"},
        {"OUTBOX_TEST_FETCH_FAULT_VERSION", T_INT, "0", O(test_fetch_fault_version), RELAY,
         -2147483647, 2147483647, NULL,
         "test hook: a fetch of a row of this aggregate_version fails (division by zero); of "
         "version -N when negative, with an error that is not the row's (an unknown setting); 0: "
         "none"},
        {"OUTBOX_TEST_FETCH_KILL_VERSION", T_INT, "0", O(test_fetch_kill_version), RELAY, 0,
         2147483647, NULL,
         "test hook: a fetch of a row of this aggregate_version ends its own server process "
         "(pg_terminate_backend), as a row that crashes it would; 0: none"},
#endif
};
#undef O
#define NOPTS (sizeof opts / sizeof opts[0])

/* Defaults that differ for one program: outboxctl is read by people at a
 * terminal, so its lines are text unless OUTBOX_LOG_FORMAT asks for json. */
static const struct {
        int programs;
        const char *env, *def;
} program_defaults[] = {{CTL, "OUTBOX_LOG_FORMAT", "text"}};

static const char *default_of(const struct opt *o, enum config_program prog) {
        for (size_t i = 0; i < sizeof program_defaults / sizeof program_defaults[0]; i++)
                if ((program_defaults[i].programs & (int)prog) &&
                    !strcmp(program_defaults[i].env, o->env))
                        return program_defaults[i].def;
        return o->def;
}
#define KAFKA_PREFIX "OUTBOX_KAFKA_"

/* Where each option's winning value came from. */
struct source {
        char *value;
        char where[160];
        int rank; /* 0 default, 1 file, 2 env, 3 flag */
};

/* "OUTBOX_BATCH_SIZE" -> "batch_size" (file key). */
static void key_of(const struct opt *o, char *out, size_t size) {
        size_t i = 0;
        for (const char *p = o->env + 7; *p && i + 1 < size; p++)
                out[i++] = (char)tolower((unsigned char)*p);
        out[i] = '\0';
}

/* "OUTBOX_BATCH_SIZE" -> "batch-size" (flag without the dashes). */
static void flag_of(const struct opt *o, char *out, size_t size) {
        key_of(o, out, size);
        for (char *p = out; *p; p++)
                if (*p == '_')
                        *p = '-';
}

char *config_kafka_property(const char *suffix) {
        size_t n = strlen(suffix);
        char *out = malloc(n + 1);
        if (!out)
                return NULL;
        size_t o = 0;
        for (size_t i = 0; i < n;) {
                if (suffix[i] == '_') {
                        size_t run = 0;
                        while (i + run < n && suffix[i + run] == '_' && run < 3)
                                run++;
                        out[o++] = run == 3 ? '-' : run == 2 ? '_' : '.';
                        i += run;
                } else {
                        out[o++] = (char)tolower((unsigned char)suffix[i++]);
                }
        }
        out[o] = '\0';
        return out;
}

int config_check_identifier(const char *table) {
        size_t part = 0;
        int parts = 1;
        /* bytes of non-ASCII characters count as letters, as in PostgreSQL's
         * unquoted identifiers; the name must be valid UTF-8 */
        if (!table || !*table || !encode_utf8_printable(table))
                return -1;
        for (const char *p = table; *p; p++) {
                if (*p == '.') {
                        if (part == 0 || ++parts > 2)
                                return -1;
                        part = 0;
                        continue;
                }
                unsigned char c = (unsigned char)*p;
                int ok = (c < 0x80 && isalpha(c)) || c >= 0x80 || *p == '_' ||
                         (part > 0 && c < 0x80 && isdigit(c));
                if (!ok || ++part > 63)
                        return -1;
        }
        return part == 0 ? -1 : 0;
}

/* Placeholders of OUTBOX_TOPIC_TEMPLATE. */
static const char *const topic_placeholders[] = {"{aggregate_type}", "{event_type}", "{tenant_id}"};

/* OUTBOX_TOPIC_TEMPLATE must be able to make a legal Kafka topic name: its
 * placeholders known, its literal parts of Kafka's characters, and short
 * enough to leave room for the values. 0, or -1 with errstr set. */
static int check_topic_template(const char *t, char *errstr, size_t size) {
        size_t literal = 0, placeholders = 0;
        if (!*t)
                return errstr_set(errstr, size, "OUTBOX_TOPIC_TEMPLATE: empty");
        for (const char *p = t; *p;) {
                size_t i, n = sizeof topic_placeholders / sizeof topic_placeholders[0];
                for (i = 0; *p == '{' && i < n; i++)
                        if (!strncmp(p, topic_placeholders[i], strlen(topic_placeholders[i])))
                                break;
                if (*p == '{' && i < n) {
                        placeholders++;
                        p += strlen(topic_placeholders[i]);
                        continue;
                }
                if (*p == '{')
                        return errstr_set(errstr, size,
                                          "OUTBOX_TOPIC_TEMPLATE: unknown placeholder at '%.40s' "
                                          "(known: {aggregate_type} {event_type} {tenant_id})",
                                          p);
                unsigned char c = (unsigned char)*p;
                if (!(c < 0x80 && (isalnum(c) || strchr("._-", c)))) {
                        char what[24];
                        if (isprint(c))
                                snprintf(what, sizeof what, "'%c' (byte 0x%02x)", c, c);
                        else
                                snprintf(what, sizeof what, "byte 0x%02x", c);
                        return errstr_set(errstr, size,
                                          "OUTBOX_TOPIC_TEMPLATE: %s at offset %zu is not allowed "
                                          "in a Kafka topic name (a-z A-Z 0-9 . _ -)",
                                          what, (size_t)(p - t));
                }
                literal++;
                p++;
        }
        /* each placeholder's value is at least one character in a legal name */
        if (literal + placeholders > ENCODE_TOPIC_MAX)
                return errstr_set(errstr, size,
                                  "OUTBOX_TOPIC_TEMPLATE: %zu characters without the placeholders' "
                                  "values; a Kafka topic name has at most %d",
                                  literal, ENCODE_TOPIC_MAX);
        if (!placeholders && !encode_topic_is_legal(t))
                return errstr_set(errstr, size,
                                  "OUTBOX_TOPIC_TEMPLATE: '%s' is not a legal Kafka topic name", t);
        return 0;
}

/* OUTBOX_RELAY_ID, OUTBOX_PRODUCER_NAME: printable UTF-8, NAME_MAX_BYTES at
 * most. 0, or -1 with errstr set. */
static int check_name(const char *var, const char *v, char *errstr, size_t size) {
        if (strlen(v) > NAME_MAX_BYTES)
                return errstr_set(errstr, size, "%s: %zu bytes, at most %d", var, strlen(v),
                                  NAME_MAX_BYTES);
        if (!encode_utf8_printable(v))
                return errstr_set(errstr, size,
                                  "%s: not printable text (control characters or invalid UTF-8)",
                                  var);
        return 0;
}

static void print_help(FILE *out, enum config_program prog) {
        fprintf(out,
                "usage: %s [--config FILE] [--NAME VALUE ...] [-X kafka.property=value ...]%s\n"
                "       %s --help | --version\n\n"
                "Settings (flag, environment variable, default):\n",
                prog == CONFIG_RELAY ? "outbox-relay" : "outbox-sweeper",
                prog == CONFIG_SWEEPER ? " [--once]" : "",
                prog == CONFIG_RELAY ? "outbox-relay" : "outbox-sweeper");
        for (size_t i = 0; i < NOPTS; i++) {
                if (!(opts[i].programs & (int)prog))
                        continue;
                char flag[64];
                flag_of(&opts[i], flag, sizeof flag);
                fprintf(out, "  --%-22s %-28s %s\n      %s\n", flag, opts[i].env,
                        opts[i].def ? (*opts[i].def ? opts[i].def : "(unset)") : "(required)",
                        opts[i].help);
        }
        fprintf(out,
                "\nlibrdkafka properties: OUTBOX_KAFKA_<NAME> (bootstrap.servers is "
                "OUTBOX_KAFKA_BOOTSTRAP_SERVERS%s),\n"
                "file key kafka_<name>, or -X name=value. In names, '_' is '.', '__' is '_', "
                "'___' is '-'.\n"
                "The --config file holds `key = value` lines; keys are the variable names "
                "without OUTBOX_, lower-cased.\n"
                "Precedence: flag > environment > file > default. Exit codes: 0 clean stop, 1 "
                "runtime error, 2 bad configuration.\n",
                prog == CONFIG_RELAY ? ", required" : "");
}

void config_print_settings(FILE *out, enum config_program prog) {
        for (size_t i = 0; i < NOPTS; i++) {
                if (!(opts[i].programs & (int)prog))
                        continue;
                const char *def = default_of(&opts[i], prog);
                fprintf(out, "  %-28s %-30s %s\n", opts[i].env,
                        def ? (*def ? def : "(unset)") : "(required)", opts[i].help);
        }
}

static int set_source(struct source *s, const char *value, int rank, const char *where) {
        if (s->rank > rank)
                return 0;
        char *v = strdup(value);
        if (!v)
                return -1;
        free(s->value);
        s->value = v;
        s->rank = rank;
        snprintf(s->where, sizeof s->where, "%s", where);
        return 0;
}

/* Adds or replaces a Kafka property (a higher rank wins). */
static int set_kafka(struct config *cfg, int *ranks, const char *name, const char *value, int rank,
                     const char *source) {
        for (size_t i = 0; i < cfg->kafka_cnt; i++) {
                if (strcmp(cfg->kafka[i].name, name) != 0)
                        continue;
                if (ranks[i] > rank)
                        return 0;
                char *v = strdup(value), *s = strdup(source);
                if (!v || !s) {
                        free(v);
                        free(s);
                        return -1;
                }
                free(cfg->kafka[i].value);
                free(cfg->kafka[i].source);
                cfg->kafka[i].value = v;
                cfg->kafka[i].source = s;
                ranks[i] = rank;
                return 0;
        }
        struct config_kafka_prop *p = &cfg->kafka[cfg->kafka_cnt];
        p->name = strdup(name);
        p->value = strdup(value);
        p->source = strdup(source);
        ranks[cfg->kafka_cnt++] = rank;
        return p->name && p->value && p->source ? 0 : -1;
}

static char *trim(char *s) {
        while (isspace((unsigned char)*s))
                s++;
        char *e = s + strlen(s);
        while (e > s && isspace((unsigned char)e[-1]))
                *--e = '\0';
        return s;
}

#define MAX_KAFKA 256

/* Opens a --config file for reading: a regular file (or a pipe or device),
 * never a directory. NULL with errstr set. */
static FILE *open_file(const char *path, char *errstr, size_t size) {
        FILE *f = fopen(path, "r");
        struct stat st;
        if (!f) {
                errstr_set(errstr, size, "--config: cannot open %s: %s", path, strerror(errno));
                return NULL;
        }
        if (fstat(fileno(f), &st) == 0 && S_ISDIR(st.st_mode)) {
                fclose(f);
                errstr_set(errstr, size, "--config: %s is a directory, not a file", path);
                return NULL;
        }
        return f;
}

static int read_file(struct config *cfg, int *kranks, struct source *src, const char *path,
                     enum config_program prog, char *errstr, size_t size) {
        FILE *f = open_file(path, errstr, size);
        if (!f)
                return -1;
        char line[4096], where[160];
        int lineno = 0, rc = 0;
        while (fgets(line, sizeof line, f)) {
                lineno++;
                if (!strchr(line, '\n') && !feof(f)) {
                        rc = errstr_set(errstr, size, "--config: %s line %d: longer than %zu bytes",
                                        path, lineno, sizeof line - 2);
                        break;
                }
                char *s = trim(line);
                if (!*s || *s == '#')
                        continue;
                char *eq = strchr(s, '=');
                if (!eq) {
                        rc = errstr_set(errstr, size, "--config: %s line %d: expected key = value",
                                        path, lineno);
                        break;
                }
                *eq = '\0';
                char *key = trim(s), *val = trim(eq + 1);
                size_t vl = strlen(val);
                if (vl >= 2 && val[0] == '"' && val[vl - 1] == '"') {
                        val[vl - 1] = '\0';
                        val++;
                }
                snprintf(where, sizeof where, "%s line %d", path, lineno);
                if (strncmp(key, "kafka_", 6) == 0 && key[6]) {
                        char *name = config_kafka_property(key + 6);
                        if (!name || cfg->kafka_cnt >= MAX_KAFKA ||
                            set_kafka(cfg, kranks, name, val, 1, key) != 0) {
                                free(name);
                                rc = errstr_set(errstr, size,
                                                "--config: too many kafka properties");
                                break;
                        }
                        free(name);
                        continue;
                }
                size_t i;
                char k[64];
                for (i = 0; i < NOPTS; i++) {
                        key_of(&opts[i], k, sizeof k);
                        if (strcmp(k, key) == 0)
                                break;
                }
                if (i == NOPTS || !(opts[i].programs & (int)prog)) {
                        rc = errstr_set(errstr, size, "--config: %s line %d: unknown key '%s'",
                                        path, lineno, key);
                        break;
                }
                if (set_source(&src[i], val, 1, where) != 0) {
                        rc = errstr_set(errstr, size, "out of memory");
                        break;
                }
        }
        if (rc == 0 && ferror(f))
                rc = errstr_set(errstr, size, "--config: cannot read %s", path);
        fclose(f);
        return rc;
}

/* "json"/"text" -> 1/0; anything else -1. */
static int log_format_value(const char *v) {
        for (int i = 0; log_format_names[i]; i++)
                if (strcasecmp(log_format_names[i], v) == 0)
                        return i;
        return -1;
}

int config_log_json_hint(enum config_program prog, int argc, char **argv) {
        const char *flag = NULL, *file = NULL;
        for (int a = 1; a < argc; a++) {
                const char *arg = argv[a];
                if (!strncmp(arg, "--log-format=", 13))
                        flag = arg + 13;
                else if (!strcmp(arg, "--log-format") && a + 1 < argc)
                        flag = argv[++a];
                else if (!strncmp(arg, "--config=", 9))
                        file = arg + 9;
                else if (!strcmp(arg, "--config") && a + 1 < argc)
                        file = argv[++a];
        }
        if (flag && log_format_value(flag) >= 0)
                return log_format_value(flag);
        const char *env = getenv("OUTBOX_LOG_FORMAT");
        if (env && log_format_value(env) >= 0)
                return log_format_value(env);
        char err[8], line[4096];
        FILE *f = file ? open_file(file, err, sizeof err) : NULL;
        int json = 1; /* the default */
        for (size_t i = 0; i < NOPTS; i++)
                if (!strcmp(opts[i].env, "OUTBOX_LOG_FORMAT"))
                        json = log_format_value(default_of(&opts[i], prog));
        while (f && fgets(line, sizeof line, f)) {
                char *eq = strchr(line, '=');
                if (!eq)
                        continue;
                *eq = '\0';
                char *val = trim(eq + 1);
                size_t vl = strlen(val);
                if (vl >= 2 && val[0] == '"' && val[vl - 1] == '"') {
                        val[vl - 1] = '\0';
                        val++;
                }
                if (!strcmp(trim(line), "log_format") && log_format_value(val) >= 0)
                        json = log_format_value(val);
        }
        if (f)
                fclose(f);
        return json;
}

/* Parses src[i] into the config field. */
static int apply(struct config *cfg, const struct opt *o, const struct source *s, char *errstr,
                 size_t size) {
        char *field = (char *)cfg + o->off;
        const char *v = s->value;
        char from[200] = "";
        if (s->rank > 0)
                snprintf(from, sizeof from, " (from %s)", s->where);

        switch (o->type) {
        case T_STR: {
                char *copy = strdup(v);
                if (!copy)
                        return errstr_set(errstr, size, "out of memory");
                *(char **)field = copy;
                return 0;
        }
        case T_INT:
        case T_LL: {
                char *end;
                errno = 0;
                long long n = strtoll(v, &end, 10);
                if (errno || end == v || *trim(end) != '\0')
                        return errstr_set(errstr, size, "%s: not an integer: '%s'%s", o->env, v,
                                          from);
                if (n < o->min || n > o->max)
                        return errstr_set(errstr, size, "%s: %lld is out of range [%lld, %lld]%s",
                                          o->env, n, o->min, o->max, from);
                if (o->type == T_INT)
                        *(int *)field = (int)n;
                else
                        *(long long *)field = n;
                return 0;
        }
        case T_ENUM:
                for (int i = 0; o->choices[i]; i++) {
                        if (strcasecmp(o->choices[i], v) == 0) {
                                *(int *)field = i;
                                return 0;
                        }
                }
                char list[128] = "";
                for (int i = 0; o->choices[i]; i++)
                        snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s",
                                 i ? ", " : "", o->choices[i]);
                return errstr_set(errstr, size, "%s: unknown value '%s' (expected one of: %s)%s",
                                  o->env, v, list, from);
        }
        return -1;
}

/* Cross-field checks after every value is parsed. */
static int validate(struct config *cfg, enum config_program prog, char *errstr, size_t size) {
        if (!cfg->database_url || !*cfg->database_url)
                return errstr_set(errstr, size, "OUTBOX_DATABASE_URL: required but not set");
        char why[300];
        if (db_conninfo_check(cfg->database_url, why, sizeof why) != 0)
                return errstr_set(errstr, size, "OUTBOX_DATABASE_URL: %s", why);
        if (config_check_identifier(cfg->table) != 0)
                return errstr_set(errstr, size,
                                  "OUTBOX_TABLE: '%s' is not an identifier or schema.identifier "
                                  "(letters, digits, _; at most 63 bytes each)",
                                  cfg->table);
        if (strcmp(cfg->http_addr, "off") != 0) {
                const char *colon = strrchr(cfg->http_addr, ':');
                char *end = NULL;
                long port = colon ? strtol(colon + 1, &end, 10) : -1;
                if (!colon || end == colon + 1 || *end || port < 0 || port > 65535)
                        return errstr_set(errstr, size,
                                          "OUTBOX_HTTP_ADDR: '%s' is not host:port or off",
                                          cfg->http_addr);
        }
        if ((prog & (RELAY | CTL)) && check_topic_template(cfg->topic_template, errstr, size))
                return -1;
        if ((prog & BOTH) && check_name("OUTBOX_RELAY_ID", cfg->relay_id, errstr, size))
                return -1;
        if ((prog & RELAY) && check_name("OUTBOX_PRODUCER_NAME", cfg->producer_name, errstr, size))
                return -1;
        if (prog == CONFIG_RELAY) {
                if (cfg->backoff_initial_ms > cfg->backoff_max_ms)
                        return errstr_set(errstr, size,
                                          "OUTBOX_BACKOFF_INITIAL_MS: %d is larger than "
                                          "OUTBOX_BACKOFF_MAX_MS %d",
                                          cfg->backoff_initial_ms, cfg->backoff_max_ms);
                size_t i;
                for (i = 0; i < cfg->kafka_cnt; i++)
                        if (strcmp(cfg->kafka[i].name, "bootstrap.servers") == 0 &&
                            *cfg->kafka[i].value)
                                break;
                if (i == cfg->kafka_cnt)
                        return errstr_set(errstr, size,
                                          "OUTBOX_KAFKA_BOOTSTRAP_SERVERS: required but not set");
                if (*cfg->schema_registry_url && strncmp(cfg->schema_registry_url, "http://", 7) &&
                    strncmp(cfg->schema_registry_url, "https://", 8))
                        return errstr_set(errstr, size,
                                          "OUTBOX_SCHEMA_REGISTRY_URL: must start with http:// or "
                                          "https://");
                struct encode_fields fields;
                if (encode_fields_parse(cfg->envelope_fields, &fields, why, sizeof why) != 0)
                        return errstr_set(errstr, size, "OUTBOX_ENVELOPE_FIELDS: %s", why);
                if (fields.n && cfg->value_format == VALUE_PAYLOAD)
                        return errstr_set(errstr, size,
                                          "OUTBOX_ENVELOPE_FIELDS: set, but OUTBOX_VALUE_FORMAT is "
                                          "payload (there is no envelope)");
                if (cfg->serialization == SERIALIZATION_JSON && *cfg->schema_registry_url)
                        return errstr_set(
                                errstr, size,
                                "OUTBOX_SCHEMA_REGISTRY_URL: set, but OUTBOX_SERIALIZATION "
                                "is json (the registry is for avro)");
        }
        if (!*cfg->relay_id) {
                char host[256] = "";
                if (gethostname(host, sizeof host - 1) != 0 || !*host)
                        snprintf(host, sizeof host, "relay");
                char id[300];
                snprintf(id, sizeof id, "%s-%ld", host, (long)getpid());
                free(cfg->relay_id);
                cfg->relay_id = strdup(id);
                if (!cfg->relay_id)
                        return errstr_set(errstr, size, "out of memory");
        }
        return 0;
}

int config_load(struct config *cfg, enum config_program prog, int argc, char **argv, FILE *out,
                char *errstr, size_t errstr_size) {
        struct source src[NOPTS];
        int kranks[MAX_KAFKA];
        const char *file = NULL;
        int rc = -1;

        memset(cfg, 0, sizeof *cfg);
        memset(src, 0, sizeof src);
        cfg->kafka = calloc(MAX_KAFKA, sizeof *cfg->kafka);
        if (!cfg->kafka)
                return errstr_set(errstr, errstr_size, "out of memory");

        for (size_t i = 0; i < NOPTS; i++) {
                const char *def = default_of(&opts[i], prog);
                if (def && set_source(&src[i], def, 0, "default") != 0)
                        goto oom;
        }

        /* Flags first, so --help and --config are known; they win later by rank. */
        for (int a = 1; a < argc; a++) {
                const char *arg = argv[a];
                if (!strcmp(arg, "--help") || !strcmp(arg, "-h")) {
                        print_help(out, prog);
                        rc = CONFIG_EXIT_HELP;
                        goto done;
                }
                if (!strcmp(arg, "--version")) {
                        fprintf(out, "%s %s (schema %s)\n",
                                prog == CONFIG_RELAY ? "outbox-relay" : "outbox-sweeper",
                                OUTBOX_VERSION, OUTBOX_SCHEMA_LEVEL);
                        rc = CONFIG_EXIT_VERSION;
                        goto done;
                }
                if (!strcmp(arg, "--once") && prog == CONFIG_SWEEPER) {
                        cfg->once = 1;
                        continue;
                }
                const char *val = NULL;
                char name[128];
                const char *eq = strchr(arg, '=');
                if (!strcmp(arg, "-X") || (strncmp(arg, "--", 2) == 0 && !eq)) {
                        if (a + 1 >= argc) {
                                rc = errstr_set(errstr, errstr_size, "%s: missing value", arg);
                                goto done;
                        }
                        val = argv[++a];
                        snprintf(name, sizeof name, "%s", arg);
                } else if (strncmp(arg, "--", 2) == 0) {
                        snprintf(name, sizeof name, "%.*s", (int)(eq - arg), arg);
                        val = eq + 1;
                } else {
                        rc = errstr_set(errstr, errstr_size,
                                        "unexpected argument '%s' (see --help)", arg);
                        goto done;
                }
                if (!strcmp(name, "--config")) {
                        file = val;
                        continue;
                }
                if (!strcmp(name, "-X")) {
                        const char *peq = strchr(val, '=');
                        if (!peq || peq == val) {
                                rc = errstr_set(errstr, errstr_size,
                                                "-X %s: expected librdkafka property=value", val);
                                goto done;
                        }
                        char prop[256], src_name[270];
                        snprintf(prop, sizeof prop, "%.*s", (int)(peq - val), val);
                        snprintf(src_name, sizeof src_name, "-X %s", prop);
                        if (cfg->kafka_cnt >= MAX_KAFKA ||
                            set_kafka(cfg, kranks, prop, peq + 1, 3, src_name) != 0)
                                goto oom;
                        continue;
                }
                size_t i;
                char f[64];
                for (i = 0; i < NOPTS; i++) {
                        flag_of(&opts[i], f, sizeof f);
                        if (!strcmp(name + 2, f) && (opts[i].programs & (int)prog))
                                break;
                }
                if (i == NOPTS) {
                        rc = errstr_set(errstr, errstr_size, "%s: unknown option (see --help)",
                                        name);
                        goto done;
                }
                char where[160];
                snprintf(where, sizeof where, "flag %s", name);
                if (set_source(&src[i], val, 3, where) != 0)
                        goto oom;
        }

        if (file && read_file(cfg, kranks, src, file, prog, errstr, errstr_size) != 0)
                goto done;

        for (size_t i = 0; i < NOPTS; i++) {
                const char *v = (opts[i].programs & (int)prog) ? getenv(opts[i].env) : NULL;
                if (v && set_source(&src[i], v, 2, "environment") != 0)
                        goto oom;
        }
        if (prog & (RELAY | CTL)) {
                for (char **e = environ; e && *e; e++) {
                        if (strncmp(*e, KAFKA_PREFIX, strlen(KAFKA_PREFIX)) != 0)
                                continue;
                        const char *eq2 = strchr(*e, '=');
                        if (!eq2)
                                continue;
                        char var[256];
                        snprintf(var, sizeof var, "%.*s", (int)(eq2 - *e), *e);
                        char *name = config_kafka_property(var + strlen(KAFKA_PREFIX));
                        if (!name || !*name || cfg->kafka_cnt >= MAX_KAFKA ||
                            set_kafka(cfg, kranks, name, eq2 + 1, 2, var) != 0) {
                                free(name);
                                rc = errstr_set(errstr, errstr_size, "%s: cannot be used", var);
                                goto done;
                        }
                        free(name);
                }
        }

        for (size_t i = 0; i < NOPTS; i++) {
                if (!(opts[i].programs & (int)prog) || !src[i].value)
                        continue;
                if (apply(cfg, &opts[i], &src[i], errstr, errstr_size) != 0)
                        goto done;
        }
        /* Strings a program does not use still get their defaults (never NULL). */
        for (size_t i = 0; i < NOPTS; i++) {
                char **field = (char **)((char *)cfg + opts[i].off);
                if (opts[i].type == T_STR && !*field && opts[i].def &&
                    !(*field = strdup(opts[i].def)))
                        goto oom;
        }
        rc = validate(cfg, prog, errstr, errstr_size);
        goto done;

oom:
        rc = errstr_set(errstr, errstr_size, "out of memory");
done:
        for (size_t i = 0; i < NOPTS; i++)
                free(src[i].value);
        return rc;
}

void config_destroy(struct config *cfg) {
        if (!cfg)
                return;
        for (size_t i = 0; i < sizeof opts / sizeof opts[0]; i++)
                if (opts[i].type == T_STR)
                        free(*(char **)((char *)cfg + opts[i].off));
        for (size_t i = 0; cfg->kafka && i < cfg->kafka_cnt; i++) {
                free(cfg->kafka[i].name);
                free(cfg->kafka[i].value);
                free(cfg->kafka[i].source);
        }
        free(cfg->kafka);
        memset(cfg, 0, sizeof *cfg);
}
