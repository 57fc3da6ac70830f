/* ctl_args.h - outboxctl's command line: the command, its options, and the
 * times and durations they take. No I/O besides the usage text. */
#ifndef OUTBOX_CTL_ARGS_H
#define OUTBOX_CTL_ARGS_H

#include <stddef.h>
#include <stdio.h>

enum ctl_command {
        CTL_NONE = 0,
        CTL_STATS,
        CTL_DEAD,
        CTL_REQUEUE,
        CTL_GAPS,
        CTL_RELEASE_GAP,
        CTL_REPLAY,
        CTL_RECONCILE,
        CTL_MIGRATE
};

/* --topic may be given this many times. */
#define CTL_TOPICS_MAX 64

/* Defaults. */
#define CTL_LIMIT_DEFAULT     100
#define CTL_EXAMPLES_DEFAULT  20
#define CTL_SINCE_DEFAULT_MS  (3600LL * 1000)       /* reconcile: the last hour */
#define CTL_MARGIN_DEFAULT_MS (5LL * 60 * 1000)     /* reconcile: 5 minutes */
#define CTL_TIME_MAX_MS       (4102444800LL * 1000) /* 2100-01-01 */

/* What ctl_args_parse() found. Strings point into argv except the
 * aggregate's type and id (ctl_args_free() frees them). Times are
 * milliseconds since the epoch. */
struct ctl_args {
        enum ctl_command cmd;
        int help;    /* --help: print the usage (of cmd, or of all) and exit 0 */
        int version; /* --version: print the program's version and exit 0 */
        long long limit;
        int has_limit;
        const char *id;
        char *aggregate_type, *aggregate_id; /* --aggregate TYPE/ID */
        const char *tenant;                  /* "default" unless --tenant */
        int all_dead;
        const char *code;
        int has_from;
        long long from_version;
        int has_since, has_until;
        long long since_ms, until_ms;
        const char *topics[CTL_TOPICS_MAX];
        size_t ntopics;
        long long margin_ms;
        long long examples;
        int json, dry_run;
};

/* Parses argv (argv[0] the program) with `now_ms` for relative times. 0, or
 * -1 with one line in errstr saying what is wrong (a usage error: exit 2;
 * a->cmd is the command when it was known). Call ctl_args_free() in every
 * case. */
int ctl_args_parse(struct ctl_args *a, int argc, char **argv, long long now_ms, char *errstr,
                   size_t errstr_size) __attribute__((warn_unused_result));

void ctl_args_free(struct ctl_args *a);

/* The usage of one command, or of all (CTL_NONE), to out. */
void ctl_usage(FILE *out, enum ctl_command cmd);

/* The command's name ("requeue"). */
const char *ctl_command_name(enum ctl_command cmd);

/* A duration: one or more <number><unit>, unit ms, s, m, h, d or w ("90s",
 * "1h30m"). 0 and *ms, or -1. */
int ctl_parse_duration(const char *s, long long *ms) __attribute__((warn_unused_result));

/* A point in time: an RFC 3339 timestamp (2024-05-01T10:00:00Z, fractions
 * and offsets allowed), `now`, or a duration meaning that long before
 * now_ms. 0 and *ms, or -1. */
int ctl_parse_time(const char *s, long long now_ms, long long *ms)
        __attribute__((warn_unused_result));

/* Nonzero when s is a UUID in its 8-4-4-4-12 hex form (len bytes, no NUL
 * needed). */
int ctl_is_uuid(const char *s, size_t len);

/* ms as RFC 3339 in UTC with milliseconds (2024-05-01T10:00:00.000Z). */
void ctl_format_time(long long ms, char *out, size_t size);

#endif
