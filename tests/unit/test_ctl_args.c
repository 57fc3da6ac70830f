/* Unit tests of ctl_args (outboxctl's command line): commands and options,
 * usage errors, times and durations, UUIDs. */
#include <criterion/criterion.h>
#include <string.h>

#include "ctl_args.h"

#define NOW 1714557600000LL /* 2024-05-01T10:00:00Z */

static struct ctl_args a;
static char err[512];

static void fini(void) {
        ctl_args_free(&a);
}

TestSuite(ctl_args, .fini = fini);

/* Parses a NULL-terminated argument list after "outboxctl". */
static int parse_v(char **args) {
        int n = 0;
        while (args[n])
                n++;
        return ctl_args_parse(&a, n, args, NOW, err, sizeof err);
}
#define PARSE(...) parse_v((char *[]){"outboxctl", __VA_ARGS__, NULL})

Test(ctl_args, commands_and_defaults) {
        cr_assert_eq(PARSE("stats"), 0, "%s", err);
        cr_assert_eq(a.cmd, CTL_STATS);
        cr_assert_eq(PARSE("dead"), 0, "%s", err);
        cr_assert_eq(a.limit, CTL_LIMIT_DEFAULT);
        cr_assert_eq(PARSE("gaps", "--limit", "7"), 0, "%s", err);
        cr_assert_eq(a.limit, 7);
        cr_assert_eq(PARSE("dead", "--limit=0"), 0, "%s", err);
        cr_assert_eq(a.limit, 0);
        cr_assert_eq(PARSE("reconcile"), 0, "%s", err);
        cr_assert_eq(a.since_ms, NOW - 3600 * 1000);
        cr_assert_eq(a.until_ms, NOW);
        cr_assert_eq(a.margin_ms, 300 * 1000);
        cr_assert_eq(a.json, 0);
}

Test(ctl_args, help) {
        cr_assert_eq(PARSE("--help"), 0);
        cr_assert(a.help && a.cmd == CTL_NONE);
        cr_assert_eq(PARSE("help"), 0);
        cr_assert(a.help);
        cr_assert_eq(PARSE("replay", "--help"), 0);
        cr_assert(a.help && a.cmd == CTL_REPLAY);
}

Test(ctl_args, version) {
        cr_assert_eq(PARSE("--version"), 0, "%s", err);
        cr_assert(a.version && a.cmd == CTL_NONE);
}

Test(ctl_args, json_everywhere_and_dry_runs) {
        const char *cmds[][4] = {{"stats"},
                                 {"dead"},
                                 {"gaps"},
                                 {"requeue", "--all-dead"},
                                 {"release-gap", "--aggregate", "A/b"},
                                 {"replay", "--since", "1h"},
                                 {"reconcile"},
                                 {"migrate"}};
        for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++) {
                char *args[6] = {"outboxctl"};
                int n = 1;
                for (int k = 0; k < 4 && cmds[i][k]; k++)
                        args[n++] = (char *)cmds[i][k];
                args[n++] = "--json";
                args[n] = NULL;
                cr_assert_eq(parse_v(args), 0, "%s: %s", cmds[i][0], err);
                cr_assert(a.json, "%s", cmds[i][0]);
        }
        cr_assert_eq(PARSE("requeue", "--id", "6f1c0000-0000-0000-0000-000000000000", "--dry-run",
                           "--limit", "5"),
                     0, "%s", err);
        cr_assert(a.dry_run && a.limit == 5);
        cr_assert_eq(PARSE("migrate", "--dry-run"), 0, "%s", err);
        cr_assert(a.dry_run && a.cmd == CTL_MIGRATE);
}

Test(ctl_args, requeue_modes) {
        cr_assert_eq(PARSE("requeue", "--id", "6F1C0000-aaaa-bbbb-cccc-0123456789ab"), 0, "%s",
                     err);
        cr_assert_str_eq(a.id, "6F1C0000-aaaa-bbbb-cccc-0123456789ab");
        cr_assert_eq(PARSE("requeue", "--aggregate", "Order/o/1", "--tenant", "acme"), 0, "%s",
                     err);
        cr_assert_str_eq(a.aggregate_type, "Order");
        cr_assert_str_eq(a.aggregate_id, "o/1"); /* split at the first slash */
        cr_assert_str_eq(a.tenant, "acme");
        cr_assert_eq(PARSE("requeue", "--all-dead", "--code", "_MSG_TIMED_OUT"), 0, "%s", err);
        cr_assert(a.all_dead);
        cr_assert_str_eq(a.code, "_MSG_TIMED_OUT");
        cr_assert_eq(PARSE("requeue", "--aggregate", "Order/x"), 0, "%s", err);
        cr_assert_str_eq(a.tenant, "default");
}

/* Each must fail with one line that names what is wrong. */
static void refused(int rc, const char *needle) {
        cr_assert_eq(rc, -1, "accepted; expected an error about %s", needle);
        cr_assert(strstr(err, needle), "'%s' not in: %s", needle, err);
        cr_assert_null(strchr(err, '\n'));
}

Test(ctl_args, usage_errors) {
        refused(PARSE("requeue", "--id", "not-a-uuid"), "'not-a-uuid' is not a UUID");
        refused(PARSE("requeue"), "give one of --id");
        refused(PARSE("requeue", "--id", "6f1c0000-0000-0000-0000-000000000000", "--all-dead"),
                "give one of");
        refused(PARSE("requeue", "--aggregate", "no-slash"), "is not TYPE/ID");
        refused(PARSE("requeue", "--aggregate", "/id"), "is not TYPE/ID");
        refused(PARSE("requeue", "--aggregate", "Type/"), "is not TYPE/ID");
        refused(PARSE("requeue", "--id", "6f1c0000-0000-0000-0000-000000000000", "--code", "X"),
                "--code goes with --all-dead");
        refused(PARSE("requeue", "--all-dead", "--tenant", "t"), "--tenant goes with --aggregate");
        refused(PARSE("dead", "--limit", "-1"), "is not a number");
        refused(PARSE("dead", "--limit", "1x"), "is not a number");
        refused(PARSE("dead", "--limit"), "--limit needs a value");
        refused(PARSE("dead", "--id", "x"), "unknown argument '--id'");
        refused(PARSE("stats", "extra"), "unknown argument 'extra'");
        refused(PARSE("release-gap"), "--aggregate TYPE/ID is required");
        refused(PARSE("replay"), "either --aggregate TYPE/ID or --since");
        refused(PARSE("replay", "--aggregate", "A/b", "--since", "1h"), "either");
        refused(PARSE("replay", "--since", "1h", "--from-version", "3"),
                "--from-version goes with --aggregate");
        refused(PARSE("replay", "--aggregate", "A/b", "--topic", "t"),
                "--until and --topic go with --since");
        refused(PARSE("replay", "--since", "1h", "--until", "2h"), "--since must be before");
        refused(PARSE("reconcile", "--since", "yesterday"), "'yesterday' is neither");
        refused(PARSE("reconcile", "--margin", "5"), "is not a duration");
        refused(PARSE("reconcile", "--json=1"), "--json takes no value");
        refused(PARSE("reconcile", "--dry-run"), "unknown argument");
        refused(PARSE("frobnicate"), "unknown command 'frobnicate'");
        refused(PARSE("requeue", "--all-dead", "--limit", "3"), "--limit goes with --dry-run");
        refused(PARSE("stats", "--dry-run"), "unknown argument '--dry-run'");
        refused(PARSE("migrate", "--limit", "3"), "unknown argument '--limit'");
        refused(PARSE("--version", "stats"), "--version takes no arguments");
        char *only[] = {"outboxctl"};
        refused(ctl_args_parse(&a, 1, only, NOW, err, sizeof err), "a command is needed");
}

Test(ctl_args, replay_forms) {
        cr_assert_eq(
                PARSE("replay", "--aggregate", "Order/o-1", "--from-version", "-3", "--dry-run"), 0,
                "%s", err);
        cr_assert(a.has_from && a.from_version == -3 && a.dry_run);
        cr_assert_eq(
                PARSE("replay", "--since", "2024-05-01T08:00:00Z", "--topic", "a", "--topic=b"), 0,
                "%s", err);
        cr_assert_eq(a.since_ms, NOW - 2 * 3600 * 1000);
        cr_assert_eq(a.until_ms, NOW);
        cr_assert_eq(a.ntopics, 2);
        cr_assert_str_eq(a.topics[1], "b");
}

Test(ctl_args, durations) {
        long long ms;
        const struct {
                const char *s;
                long long ms;
        } ok[] = {{"90s", 90000},    {"15m", 900000},    {"1h30m", 5400000},
                  {"7d", 604800000}, {"2w", 1209600000}, {"250ms", 250},
                  {"1m30s", 90000},  {"0s", 0},          {"1h1ms", 3600001}};
        for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
                cr_assert_eq(ctl_parse_duration(ok[i].s, &ms), 0, "%s", ok[i].s);
                cr_assert_eq(ms, ok[i].ms, "%s: %lld", ok[i].s, ms);
        }
        const char *bad[] = {"",
                             "5",
                             "m",
                             "1x",
                             "1h 30m",
                             "-1h",
                             "1.5h",
                             "h1",
                             "99999999999999999999s",
                             "5000000000000d"};
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
                cr_assert_eq(ctl_parse_duration(bad[i], &ms), -1, "accepted '%s'", bad[i]);
}

Test(ctl_args, times) {
        long long ms;
        const struct {
                const char *s;
                long long ms;
        } ok[] = {{"2024-05-01T10:00:00Z", NOW},
                  {"2024-05-01t10:00:00z", NOW},
                  {"2024-05-01 10:00:00Z", NOW},
                  {"2024-05-01T12:00:00+02:00", NOW},
                  {"2024-05-01T05:30:00-04:30", NOW},
                  {"2024-05-01T10:00:00.5Z", NOW + 500},
                  {"2024-05-01T10:00:00.123456789Z", NOW + 123},
                  {"1970-01-01T00:00:00Z", 0},
                  {"2024-02-29T00:00:00Z", 1709164800000LL},
                  {"now", NOW},
                  {"1h", NOW - 3600000},
                  {"90m", NOW - 5400000}};
        for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
                cr_assert_eq(ctl_parse_time(ok[i].s, NOW, &ms), 0, "%s", ok[i].s);
                cr_assert_eq(ms, ok[i].ms, "%s: %lld", ok[i].s, ms);
        }
        const char *bad[] = {"2024-05-01",
                             "2024-05-01T10:00:00",
                             "2024-13-01T00:00:00Z",
                             "2023-02-29T00:00:00Z",
                             "2024-04-31T00:00:00Z",
                             "2024-05-01T24:00:00Z",
                             "2024-05-01T10:60:00Z",
                             "2024-05-01T10:00:00.Z",
                             "2024-05-01T10:00:00+2",
                             "2024-05-01T10:00:00Zjunk",
                             "yesterday",
                             "2024-05-01T10:00:00.1234567890Z",
                             "60000w",
                             "1969-12-31T23:59:59Z"};
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
                cr_assert_eq(ctl_parse_time(bad[i], NOW, &ms), -1, "accepted '%s'", bad[i]);
}

Test(ctl_args, uuid_and_format) {
        cr_assert(ctl_is_uuid("6f1c0000-aaaa-bbbb-cccc-0123456789ab", 36));
        cr_assert(!ctl_is_uuid("6f1c0000aaaa-bbbb-cccc-0123456789ab-", 36));
        cr_assert(!ctl_is_uuid("6f1c0000-aaaa-bbbb-cccc-0123456789ag", 36));
        cr_assert(!ctl_is_uuid("6f1c0000-aaaa-bbbb-cccc-0123456789a", 35));
        char out[40];
        ctl_format_time(NOW + 7, out, sizeof out);
        cr_assert_str_eq(out, "2024-05-01T10:00:00.007Z");
        long long back;
        cr_assert_eq(ctl_parse_time(out, 0, &back), 0);
        cr_assert_eq(back, NOW + 7);
}
