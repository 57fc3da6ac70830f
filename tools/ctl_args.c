/* ctl_args.c - outboxctl's command line. Hand-written: getopt_long knows
 * no subcommands and prints its own errors to stderr (only log does), while
 * one table of options and commands gives every usage error one line. */
#include "ctl_args.h"

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "errstr.h"

#define BIT(c) (1u << (c))

static const struct {
        enum ctl_command cmd;
        const char *name, *synopsis, *text;
} commands[] = {
        {CTL_STATS, "stats", "stats [--json]", "rows by status, the age of the oldest due row"},
        {CTL_DEAD, "dead", "dead [--limit N] [--json]",
         "DEAD rows: id, aggregate, version, code, message (at most N, default 100)"},
        {CTL_REQUEUE, "requeue",
         "requeue (--id UUID | --aggregate TYPE/ID [--tenant T] | --all-dead [--code CODE])\n"
         "           [--dry-run [--limit N]] [--json]",
         "DEAD -> PENDING (attempts 0, due now): one row, one aggregate's, or all\n"
         "    (with that last_error_code); the versions parked behind them are due again.\n"
         "    Prints `requeued N row(s)[, M parked version(s) due again]`. --dry-run lists\n"
         "    the rows it would move (at most N, default 100) and the parked versions it\n"
         "    would free, and changes nothing"},
        {CTL_GAPS, "gaps", "gaps [--limit N] [--json]",
         "aggregates whose next version waits for versions not in the table (a gap)"},
        {CTL_RELEASE_GAP, "release-gap", "release-gap --aggregate TYPE/ID [--tenant T] [--json]",
         "lets the held version go without the missing ones, recording them as\n"
         "    released (a PUBLISHED row of event_type 'outbox.gap-released', last_error_code\n"
         "    GAP_RELEASED, never sent); exit 1 when no gap holds the aggregate"},
        {CTL_REPLAY, "replay",
         "replay (--aggregate TYPE/ID [--tenant T] [--from-version N] |\n"
         "           --since T [--until T] [--topic TOPIC ...]) [--dry-run] [--examples N]\n"
         "           [--json]",
         "PUBLISHED -> PENDING, so the relays publish the rows again, in version order:\n"
         "    one aggregate (from version N), or every aggregate with rows published in\n"
         "    [since, until) (of those topics). Each aggregate is replayed from its lowest\n"
         "    selected version to its latest; rows not PUBLISHED, rows below a released gap\n"
         "    and aggregates with a version being published now are left as they are (and\n"
         "    counted; exit 1 when any selected row was refused). GAP_RELEASED records are\n"
         "    never replayed. --dry-run prints what it would move"},
        {CTL_RECONCILE, "reconcile",
         "reconcile [--since T] [--until T] [--topic TOPIC ...] [--margin D] [--examples N]\n"
         "           [--json]",
         "compares the PUBLISHED rows published in [since, until) (default: the last hour)\n"
         "    with the topics' messages whose timestamps fall in the window widened by the\n"
         "    margin (default 5m): missing (rows not on Kafka), reorders (a first copy of a\n"
         "    version after a higher version's, per aggregate and partition), duplicates\n"
         "    and unknown messages (event id not in the table). Partitions a broker cannot\n"
         "    look up by time are read from their start. Exit 1 when missing or reorders\n"
         "    is not 0, 3 when partitions could not be read (missing: cannot tell). Needs\n"
         "    OUTBOX_KAFKA_BOOTSTRAP_SERVERS"},
        {CTL_MIGRATE, "migrate", "migrate [--dry-run] [--json]",
         "applies the schema migrations built into this program (schemas/postgres) that\n"
         "    the database has not recorded, in order, each in its own transaction, under\n"
         "    an advisory lock; creates OUTBOX_TABLE's table (it must be named outbox_event,\n"
         "    in any schema). Exit 1 when the database records a migration newer than this\n"
         "    program knows. --dry-run lists what it would apply"},
};
#define NCOMMANDS (sizeof commands / sizeof commands[0])

enum opt_id {
        O_LIMIT,
        O_ID,
        O_AGGREGATE,
        O_TENANT,
        O_ALL_DEAD,
        O_CODE,
        O_FROM_VERSION,
        O_SINCE,
        O_UNTIL,
        O_TOPIC,
        O_MARGIN,
        O_EXAMPLES,
        O_JSON,
        O_DRY_RUN,
        O_HELP
};

/* The commands that print JSON with --json: all of them. */
#define JSON_CMDS                                                                                  \
        (BIT(CTL_STATS) | BIT(CTL_DEAD) | BIT(CTL_REQUEUE) | BIT(CTL_GAPS) |                       \
         BIT(CTL_RELEASE_GAP) | BIT(CTL_REPLAY) | BIT(CTL_RECONCILE) | BIT(CTL_MIGRATE))

static const struct {
        enum opt_id id;
        const char *name;
        int takes_value;
        unsigned cmds; /* BIT(command) of the commands that take it */
} options[] = {
        {O_LIMIT, "--limit", 1, BIT(CTL_DEAD) | BIT(CTL_GAPS) | BIT(CTL_REQUEUE)},
        {O_ID, "--id", 1, BIT(CTL_REQUEUE)},
        {O_AGGREGATE, "--aggregate", 1, BIT(CTL_REQUEUE) | BIT(CTL_RELEASE_GAP) | BIT(CTL_REPLAY)},
        {O_TENANT, "--tenant", 1, BIT(CTL_REQUEUE) | BIT(CTL_RELEASE_GAP) | BIT(CTL_REPLAY)},
        {O_ALL_DEAD, "--all-dead", 0, BIT(CTL_REQUEUE)},
        {O_CODE, "--code", 1, BIT(CTL_REQUEUE)},
        {O_FROM_VERSION, "--from-version", 1, BIT(CTL_REPLAY)},
        {O_SINCE, "--since", 1, BIT(CTL_REPLAY) | BIT(CTL_RECONCILE)},
        {O_UNTIL, "--until", 1, BIT(CTL_REPLAY) | BIT(CTL_RECONCILE)},
        {O_TOPIC, "--topic", 1, BIT(CTL_REPLAY) | BIT(CTL_RECONCILE)},
        {O_MARGIN, "--margin", 1, BIT(CTL_RECONCILE)},
        {O_EXAMPLES, "--examples", 1, BIT(CTL_REPLAY) | BIT(CTL_RECONCILE)},
        {O_JSON, "--json", 0, JSON_CMDS},
        {O_DRY_RUN, "--dry-run", 0, BIT(CTL_REPLAY) | BIT(CTL_REQUEUE) | BIT(CTL_MIGRATE)},
        {O_HELP, "--help", 0, ~0u},
};
#define NOPTIONS (sizeof options / sizeof options[0])

const char *ctl_command_name(enum ctl_command cmd) {
        for (size_t i = 0; i < NCOMMANDS; i++)
                if (commands[i].cmd == cmd)
                        return commands[i].name;
        return "outboxctl";
}

void ctl_usage(FILE *out, enum ctl_command cmd) {
        if (cmd == CTL_NONE)
                fprintf(out, "usage: outboxctl COMMAND [OPTIONS]   (outboxctl COMMAND --help)\n"
                             "       outboxctl --help | --version\n\n"
                             "Commands:\n");
        for (size_t i = 0; i < NCOMMANDS; i++)
                if (cmd == CTL_NONE || commands[i].cmd == cmd)
                        fprintf(out, "%s%s\n    %s\n", cmd == CTL_NONE ? "  " : "usage: outboxctl ",
                                commands[i].synopsis, commands[i].text);
        if (cmd == CTL_REPLAY || cmd == CTL_RECONCILE || cmd == CTL_NONE)
                fprintf(out, "\nTimes (T): RFC 3339 (2024-05-01T10:00:00Z, +02:00 offsets), `now`, "
                             "or a duration\nbefore now; durations (D): 90s, 15m, 1h30m, 7d "
                             "(units ms, s, m, h, d, w).\n");
}

/* A decimal integer, the whole string. */
static int parse_ll(const char *s, long long min, long long *out) {
        char *end;
        errno = 0;
        long long v = strtoll(s, &end, 10);
        if (errno || end == s || *end || !(isdigit((unsigned char)*s) || *s == '-') || v < min)
                return -1;
        *out = v;
        return 0;
}

int ctl_parse_duration(const char *s, long long *ms) {
        static const struct {
                const char *unit;
                long long ms;
        } units[] = {{"ms", 1},
                     {"s", 1000},
                     {"m", 60000},
                     {"h", 3600 * 1000LL},
                     {"d", 86400 * 1000LL},
                     {"w", 7 * 86400 * 1000LL}};
        long long total = 0;
        const char *p = s;
        if (!*p)
                return -1;
        while (*p) {
                if (!isdigit((unsigned char)*p))
                        return -1;
                long long n = 0;
                while (isdigit((unsigned char)*p)) {
                        n = n * 10 + (*p++ - '0');
                        if (n > CTL_TIME_MAX_MS)
                                return -1;
                }
                size_t u, len = 0;
                for (u = 0; u < sizeof units / sizeof units[0]; u++) {
                        len = strlen(units[u].unit);
                        /* "m" must not take the "m" of "ms" */
                        if (!strncmp(p, units[u].unit, len) &&
                            !(len == 1 && p[0] == 'm' && p[1] == 's'))
                                break;
                }
                if (u == sizeof units / sizeof units[0])
                        return -1;
                p += len;
                if (n > CTL_TIME_MAX_MS / units[u].ms)
                        return -1;
                total += n * units[u].ms;
                if (total > CTL_TIME_MAX_MS)
                        return -1;
        }
        *ms = total;
        return 0;
}

/* Days since 1970-01-01 of a civil date (proleptic Gregorian). */
static long long days_from_civil(long long y, unsigned m, unsigned d) {
        y -= m <= 2;
        long long era = (y >= 0 ? y : y - 399) / 400;
        unsigned yoe = (unsigned)(y - era * 400);
        unsigned doy = (153 * (m + (m > 2 ? (unsigned)-3 : 9)) + 2) / 5 + d - 1;
        unsigned doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
        return era * 146097 + (long long)doe - 719468;
}

/* n digits at *p as a number; advances *p. -1 if not n digits. */
static int digits(const char **p, int n) {
        int v = 0;
        for (int i = 0; i < n; i++) {
                if (!isdigit((unsigned char)(*p)[i]))
                        return -1;
                v = v * 10 + ((*p)[i] - '0');
        }
        *p += n;
        return v;
}

/* RFC 3339: date-time with T (or t, or a space), optional fraction, Z or an
 * offset. Not strptime(): it takes no fraction, and its %z differs between C
 * libraries. */
static int parse_rfc3339(const char *s, long long *ms) {
        static const int mdays[] = {31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
        const char *p = s;
        int y = digits(&p, 4);
        if (y < 0 || *p++ != '-')
                return -1;
        int mo = digits(&p, 2);
        if (mo < 1 || mo > 12 || *p++ != '-')
                return -1;
        int d = digits(&p, 2);
        int leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
        if (d < 1 || d > mdays[mo - 1] || (mo == 2 && d == 29 && !leap))
                return -1;
        if (*p != 'T' && *p != 't' && *p != ' ')
                return -1;
        p++;
        int h = digits(&p, 2);
        if (h < 0 || h > 23 || *p++ != ':')
                return -1;
        int mi = digits(&p, 2);
        if (mi < 0 || mi > 59 || *p++ != ':')
                return -1;
        int sec = digits(&p, 2);
        if (sec < 0 || sec > 60)
                return -1;
        long long frac_ms = 0;
        if (*p == '.') {
                int n = 0;
                for (p++; isdigit((unsigned char)*p); p++, n++)
                        if (n < 3)
                                frac_ms = frac_ms * 10 + (*p - '0');
                if (n == 0 || n > 9)
                        return -1;
                for (; n < 3; n++) /* ".5" is 500 ms */
                        frac_ms *= 10;
        }
        long long offset_s = 0;
        if (*p == 'Z' || *p == 'z') {
                p++;
        } else if (*p == '+' || *p == '-') {
                int sign = *p++ == '-' ? -1 : 1;
                int oh = digits(&p, 2);
                if (oh < 0 || oh > 23 || *p++ != ':')
                        return -1;
                int om = digits(&p, 2);
                if (om < 0 || om > 59)
                        return -1;
                offset_s = sign * (oh * 3600LL + om * 60LL);
        } else {
                return -1;
        }
        if (*p)
                return -1;
        long long t = days_from_civil(y, (unsigned)mo, (unsigned)d) * 86400 + h * 3600LL +
                      mi * 60LL + sec - offset_s;
        *ms = t * 1000 + frac_ms;
        return 0;
}

int ctl_parse_time(const char *s, long long now_ms, long long *ms) {
        long long d;
        if (!strcmp(s, "now")) {
                *ms = now_ms;
                return 0;
        }
        if (strlen(s) >= 10 && s[4] == '-') {
                long long t;
                if (parse_rfc3339(s, &t) != 0 || t < 0 || t > CTL_TIME_MAX_MS)
                        return -1;
                *ms = t;
                return 0;
        }
        if (ctl_parse_duration(s, &d) != 0 || d > now_ms)
                return -1;
        *ms = now_ms - d;
        return 0;
}

int ctl_is_uuid(const char *s, size_t len) {
        if (len != 36)
                return 0;
        for (size_t i = 0; i < 36; i++) {
                if (i == 8 || i == 13 || i == 18 || i == 23) {
                        if (s[i] != '-')
                                return 0;
                } else if (!isxdigit((unsigned char)s[i])) {
                        return 0;
                }
        }
        return 1;
}

void ctl_format_time(long long ms, char *out, size_t size) {
        time_t t = (time_t)(ms / 1000);
        struct tm tm;
        if (ms < 0 || !gmtime_r(&t, &tm)) {
                snprintf(out, size, "-");
                return;
        }
        char base[32];
        strftime(base, sizeof base, "%Y-%m-%dT%H:%M:%S", &tm);
        snprintf(out, size, "%s.%03lldZ", base, ms % 1000);
}

void ctl_args_free(struct ctl_args *a) {
        free(a->aggregate_type);
        free(a->aggregate_id);
        a->aggregate_type = a->aggregate_id = NULL;
}

/* --aggregate TYPE/ID: split at the first '/' (an id may hold more). */
static int set_aggregate(struct ctl_args *a, const char *v, const char *cmd, char *errstr,
                         size_t size) {
        const char *slash = strchr(v, '/');
        if (!slash || slash == v || !slash[1])
                return errstr_set(errstr, size, "%s: --aggregate TYPE/ID: '%s' is not TYPE/ID", cmd,
                                  v);
        free(a->aggregate_type);
        free(a->aggregate_id);
        a->aggregate_type = strndup(v, (size_t)(slash - v));
        a->aggregate_id = strdup(slash + 1);
        if (!a->aggregate_type || !a->aggregate_id)
                return errstr_set(errstr, size, "out of memory");
        return 0;
}

/* Applies one option and its value (NULL when it takes none). */
static int apply(struct ctl_args *a, enum opt_id id, const char *name, const char *v,
                 long long now_ms, int *tenant_given, char *errstr, size_t size) {
        const char *cmd = ctl_command_name(a->cmd);
        switch (id) {
        case O_LIMIT:
        case O_EXAMPLES:
                if (parse_ll(v, 0, id == O_LIMIT ? &a->limit : &a->examples) != 0)
                        return errstr_set(errstr, size,
                                          "%s: %s N: '%s' is not a number (0 or more)", cmd, name,
                                          v);
                if (id == O_LIMIT)
                        a->has_limit = 1;
                return 0;
        case O_ID:
                if (!ctl_is_uuid(v, strlen(v)))
                        return errstr_set(errstr, size,
                                          "%s: --id: '%s' is not a UUID (8-4-4-4-12 hex digits)",
                                          cmd, v);
                a->id = v;
                return 0;
        case O_AGGREGATE: return set_aggregate(a, v, cmd, errstr, size);
        case O_TENANT:
                a->tenant = v;
                *tenant_given = 1;
                return 0;
        case O_ALL_DEAD: a->all_dead = 1; return 0;
        case O_CODE: a->code = v; return 0;
        case O_FROM_VERSION:
                if (parse_ll(v, LLONG_MIN, &a->from_version) != 0)
                        return errstr_set(errstr, size,
                                          "%s: --from-version N: '%s' is not a version number", cmd,
                                          v);
                a->has_from = 1;
                return 0;
        case O_SINCE:
        case O_UNTIL:
                if (ctl_parse_time(v, now_ms, id == O_SINCE ? &a->since_ms : &a->until_ms) != 0)
                        return errstr_set(errstr, size,
                                          "%s: %s: '%s' is neither an RFC 3339 time "
                                          "(2024-05-01T10:00:00Z), now, nor a duration (90s, "
                                          "15m, 2h, 7d)",
                                          cmd, name, v);
                *(id == O_SINCE ? &a->has_since : &a->has_until) = 1;
                return 0;
        case O_TOPIC:
                if (!*v)
                        return errstr_set(errstr, size, "%s: --topic: empty", cmd);
                if (a->ntopics >= CTL_TOPICS_MAX)
                        return errstr_set(errstr, size, "%s: --topic: at most %d", cmd,
                                          CTL_TOPICS_MAX);
                a->topics[a->ntopics++] = v;
                return 0;
        case O_MARGIN:
                if (ctl_parse_duration(v, &a->margin_ms) != 0)
                        return errstr_set(errstr, size,
                                          "%s: --margin: '%s' is not a duration (90s, 15m, 2h)",
                                          cmd, v);
                return 0;
        case O_JSON: a->json = 1; return 0;
        case O_DRY_RUN: a->dry_run = 1; return 0;
        case O_HELP: a->help = 1; return 0;
        }
        return -1;
}

/* Which of the options given go together, per command. */
static int check(struct ctl_args *a, int tenant_given, long long now_ms, char *errstr,
                 size_t size) {
        const char *cmd = ctl_command_name(a->cmd);
        switch (a->cmd) {
        case CTL_REQUEUE: {
                int modes = !!a->id + !!a->aggregate_id + a->all_dead;
                if (modes != 1)
                        return errstr_set(errstr, size,
                                          "requeue: give one of --id UUID, --aggregate TYPE/ID or "
                                          "--all-dead");
                if (a->code && !a->all_dead)
                        return errstr_set(errstr, size, "requeue: --code goes with --all-dead");
                if (a->has_limit && !a->dry_run)
                        return errstr_set(errstr, size, "requeue: --limit goes with --dry-run");
                break;
        }
        case CTL_RELEASE_GAP:
                if (!a->aggregate_id)
                        return errstr_set(errstr, size,
                                          "release-gap: --aggregate TYPE/ID is required");
                break;
        case CTL_REPLAY:
                if (!!a->aggregate_id == a->has_since)
                        return errstr_set(errstr, size,
                                          "replay: give either --aggregate TYPE/ID or --since T");
                if (a->has_from && !a->aggregate_id)
                        return errstr_set(errstr, size,
                                          "replay: --from-version goes with --aggregate");
                if ((a->has_until || a->ntopics) && !a->has_since)
                        return errstr_set(errstr, size,
                                          "replay: --until and --topic go with --since");
                break;
        case CTL_RECONCILE:
                if (!a->has_since)
                        a->since_ms = now_ms - CTL_SINCE_DEFAULT_MS;
                break;
        default: break;
        }
        if (tenant_given && !a->aggregate_id)
                return errstr_set(errstr, size, "%s: --tenant goes with --aggregate", cmd);
        if ((a->cmd == CTL_REPLAY && a->has_since) || a->cmd == CTL_RECONCILE) {
                if (!a->has_until)
                        a->until_ms = now_ms;
                if (a->since_ms >= a->until_ms)
                        return errstr_set(errstr, size, "%s: --since must be before --until", cmd);
        }
        return 0;
}

int ctl_args_parse(struct ctl_args *a, int argc, char **argv, long long now_ms, char *errstr,
                   size_t errstr_size) {
        int tenant_given = 0;
        memset(a, 0, sizeof *a);
        a->limit = CTL_LIMIT_DEFAULT;
        a->examples = CTL_EXAMPLES_DEFAULT;
        a->margin_ms = CTL_MARGIN_DEFAULT_MS;
        a->tenant = "default";
        if (argc < 2)
                return errstr_set(errstr, errstr_size,
                                  "a command is needed: stats, dead, requeue, gaps, release-gap, "
                                  "replay, reconcile or migrate");
        const char *word = argv[1];
        if (!strcmp(word, "--help") || !strcmp(word, "-h") || !strcmp(word, "help")) {
                a->help = 1;
                return 0;
        }
        if (!strcmp(word, "--version")) {
                if (argc > 2)
                        return errstr_set(errstr, errstr_size, "--version takes no arguments");
                a->version = 1;
                return 0;
        }
        for (size_t i = 0; i < NCOMMANDS; i++)
                if (!strcmp(word, commands[i].name))
                        a->cmd = commands[i].cmd;
        if (a->cmd == CTL_NONE)
                return errstr_set(errstr, errstr_size,
                                  "unknown command '%s' (stats, dead, requeue, gaps, release-gap, "
                                  "replay, reconcile, migrate)",
                                  word);
        for (int i = 2; i < argc; i++) {
                const char *arg = argv[i], *eq = strchr(arg, '='), *v = NULL;
                size_t nlen = eq && !strncmp(arg, "--", 2) ? (size_t)(eq - arg) : strlen(arg);
                size_t o;
                for (o = 0; o < NOPTIONS; o++)
                        if (strlen(options[o].name) == nlen && !strncmp(arg, options[o].name, nlen))
                                break;
                if (o == NOPTIONS || !(options[o].cmds & BIT(a->cmd)))
                        return errstr_set(errstr, errstr_size, "%s: unknown argument '%s'", word,
                                          arg);
                if (options[o].takes_value) {
                        if (nlen < strlen(arg))
                                v = arg + nlen + 1;
                        else if (i + 1 < argc)
                                v = argv[++i];
                        else
                                return errstr_set(errstr, errstr_size, "%s: %s needs a value", word,
                                                  options[o].name);
                } else if (nlen < strlen(arg)) {
                        return errstr_set(errstr, errstr_size, "%s: %s takes no value", word,
                                          options[o].name);
                }
                if (apply(a, options[o].id, options[o].name, v, now_ms, &tenant_given, errstr,
                          errstr_size) != 0)
                        return -1;
        }
        if (a->help)
                return 0;
        return check(a, tenant_given, now_ms, errstr, errstr_size);
}
