/* db_conninfo.c - OUTBOX_DATABASE_URL parsed by libpq's PQconninfoParse, so
 * the check and the redacted form agree with what libpq connects with. */
#include "db_conninfo.h"

#include <errno.h>
#include <libpq-fe.h>
#include <limits.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>

#include "errstr.h"

#define HIDDEN "****"

/* PQconnectdbParams with expand_dbname expands a dbname that is a URI or
 * holds '=' (libpq's recognized_connection_string); anything else is a
 * database name. */
static int is_conninfo(const char *s) {
        return !strncmp(s, "postgresql://", 13) || !strncmp(s, "postgres://", 11) ||
               strchr(s, '=') != NULL;
}

/* libpq's options for s, or NULL with libpq's message in *msg (PQfreemem). */
static PQconninfoOption *parse(const char *s, char **msg) {
        *msg = NULL;
        if (is_conninfo(s) || !*s)
                return PQconninfoParse(s, msg);
        PQconninfoOption *opts = PQconninfoParse("", msg);
        for (PQconninfoOption *o = opts; o && o->keyword; o++) {
                if (strcmp(o->keyword, "dbname") == 0) {
                        o->val = strdup(s); /* PQconninfoFree() frees it */
                        if (!o->val) {
                                PQconninfoFree(opts);
                                return NULL;
                        }
                }
        }
        return opts;
}

/* The value of `keyword` in opts: NULL when not given; with `empty_unset`,
 * also when given empty (libpq treats an empty host or port as not given,
 * but checks an empty sslmode or connect_timeout like any value). */
static const char *value_of(const PQconninfoOption *opts, const char *keyword, int empty_unset) {
        for (const PQconninfoOption *o = opts; o->keyword; o++)
                if (strcmp(o->keyword, keyword) == 0)
                        return o->val && (*o->val || !empty_unset) ? o->val : NULL;
        return NULL;
}

/* What libpq's parse error means, in our words: its own message quotes the
 * string (a URI error quotes all of it, password included), and a
 * translation may quote with other characters, so none of it is copied. */
static const char *parse_problem(const char *msg) {
        static const struct {
                const char *libpq, *ours;
        } known[] = {
                {"missing \"=\" after", "a keyword without '=' (quote a value with spaces in "
                                        "single quotes)"},
                {"unterminated quoted string", "a quoted value without its closing quote"},
                {"invalid connection option", "an unknown keyword"},
                {"invalid URI query parameter", "an unknown URI query parameter"},
                {"end of string reached when looking for matching \"]\"",
                 "an IPv6 host address in the URI without its closing ']'"},
                {"IPv6 host address may not be empty", "an empty IPv6 host address in the URI"},
                {"unexpected character", "an unexpected character in the URI's host and port"},
                {"extra key/value separator", "a URI query parameter with two '='"},
                {"missing key/value separator", "a URI query parameter without '='"},
                {"invalid percent-encoded token", "an invalid %-escape in the URI"},
                {"forbidden value %00", "%00 in the URI"},
                {"out of memory", "out of memory"},
        };
        for (size_t i = 0; msg && i < sizeof known / sizeof known[0]; i++)
                if (strncmp(msg, known[i].libpq, strlen(known[i].libpq)) == 0)
                        return known[i].ours;
        return "libpq refuses it";
}

/* libpq's parse_int_param(): an int, surrounding whitespace allowed. */
static int is_int(const char *v) {
        char *end;
        errno = 0;
        long n = strtol(v, &end, 10);
        if (end == v || errno || n < INT_MIN || n > INT_MAX)
                return 0;
        while (*end == ' ' || *end == '\t' || *end == '\n' || *end == '\r' || *end == '\f' ||
               *end == '\v')
                end++;
        return *end == '\0';
}

/* Elements of a comma-separated list (libpq's count_comma_separated_elems). */
static int count_elems(const char *v) {
        int n = 1;
        for (; *v; v++)
                if (*v == ',')
                        n++;
        return n;
}

/* 1 when every non-empty element of the comma-separated list v passes ok()
 * (an empty element is the default); an element of 256 bytes or more fails. */
static int each_elem(const char *v, int (*ok)(const char *one)) {
        char one[256];
        while (v) {
                const char *comma = strchr(v, ',');
                size_t n = comma ? (size_t)(comma - v) : strlen(v);
                if (n >= sizeof one)
                        return 0;
                memcpy(one, v, n);
                one[n] = '\0';
                if (n && !ok(one))
                        return 0;
                v = comma ? comma + 1 : NULL;
        }
        return 1;
}

/* A port, as libpq checks it when it connects to that host. */
static int port_ok(const char *one) {
        return is_int(one) && atoi(one) >= 1 && atoi(one) <= 65535;
}

/* A numeric address: libpq resolves hostaddr with AI_NUMERICHOST, so no name
 * lookup happens here either. */
static int hostaddr_ok(const char *one) {
        struct addrinfo hints, *res = NULL;
        memset(&hints, 0, sizeof hints);
        hints.ai_flags = AI_NUMERICHOST;
        hints.ai_socktype = SOCK_STREAM;
        if (getaddrinfo(one, NULL, &hints, &res) != 0)
                return 0;
        freeaddrinfo(res);
        return 1;
}

static int one_of(const char *v, const char *const *choices, int nocase) {
        for (; *choices; choices++)
                if (nocase ? !strcasecmp(v, *choices) : !strcmp(v, *choices))
                        return 1;
        return 0;
}

/* TLS versions in libpq's order; "" is no bound. */
static int tls_rank(const char *v) {
        static const char *const versions[] = {"TLSv1", "TLSv1.1", "TLSv1.2", "TLSv1.3"};
        for (int i = 0; i < 4; i++)
                if (!strcasecmp(v, versions[i]))
                        return i;
        return -1;
}

/* The checks libpq 15 makes only when it connects (connectOptions2(), and
 * the integer options of PQconnectPoll()): none of them quotes a value. */
static int check_values(const PQconninfoOption *opts, char *errstr, size_t size) {
        static const struct {
                const char *keyword;
                const char *const choices[7];
                const char *expected;
        } enums[] = {
                {"sslmode",
                 {"disable", "allow", "prefer", "require", "verify-ca", "verify-full"},
                 "disable, allow, prefer, require, verify-ca or verify-full"},
                {"gssencmode", {"disable", "prefer", "require"}, "disable, prefer or require"},
                {"channel_binding", {"disable", "prefer", "require"}, "disable, prefer or require"},
                {"target_session_attrs",
                 {"any", "read-write", "read-only", "primary", "standby", "prefer-standby"},
                 "any, read-write, read-only, primary, standby or prefer-standby"},
        };
        static const char *const ints[] = {"connect_timeout",  "keepalives",
                                           "keepalives_idle",  "keepalives_interval",
                                           "keepalives_count", "tcp_user_timeout"};
        for (size_t i = 0; i < sizeof enums / sizeof enums[0]; i++) {
                const char *v = value_of(opts, enums[i].keyword, 0);
                if (v && !one_of(v, enums[i].choices, 0))
                        return errstr_set(errstr, size, "%s: not one of %s", enums[i].keyword,
                                          enums[i].expected);
        }
        for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++) {
                const char *v = value_of(opts, ints[i], 0);
                if (v && !is_int(v))
                        return errstr_set(errstr, size, "%s: not an integer", ints[i]);
        }
        const char *min = value_of(opts, "ssl_min_protocol_version", 1);
        const char *max = value_of(opts, "ssl_max_protocol_version", 1);
        if ((min && tls_rank(min) < 0) || (max && tls_rank(max) < 0))
                return errstr_set(errstr, size,
                                  "ssl_%s_protocol_version: not one of TLSv1, TLSv1.1, TLSv1.2 "
                                  "or TLSv1.3",
                                  min && tls_rank(min) < 0 ? "min" : "max");
        if (min && max && tls_rank(min) > tls_rank(max))
                return errstr_set(errstr, size,
                                  "ssl_min_protocol_version is above ssl_max_protocol_version");
        const char *host = value_of(opts, "host", 1);
        const char *hostaddr = value_of(opts, "hostaddr", 1);
        const char *port = value_of(opts, "port", 1);
        if (hostaddr && !each_elem(hostaddr, hostaddr_ok))
                return errstr_set(errstr, size, "hostaddr: not a numeric IP address");
        int hosts = host ? count_elems(host) : 1;
        if (host && hostaddr && count_elems(hostaddr) != hosts)
                return errstr_set(errstr, size, "%d host names but %d hostaddr values", hosts,
                                  count_elems(hostaddr));
        if (!host && hostaddr)
                hosts = count_elems(hostaddr);
        if (port && !each_elem(port, port_ok))
                return errstr_set(errstr, size, "port: not a port number (1-65535)");
        if (port && count_elems(port) != 1 && count_elems(port) != hosts)
                return errstr_set(errstr, size, "%d port numbers for %d hosts", count_elems(port),
                                  hosts);
        return 0;
}

int db_conninfo_check(const char *conninfo, char *errstr, size_t errstr_size) {
        char *msg = NULL;
        PQconninfoOption *opts = parse(conninfo ? conninfo : "", &msg);
        int rc;
        if (!opts) {
                rc = errstr_set(errstr, errstr_size,
                                "not a valid libpq connection string or URI: %s (libpq's message "
                                "is not shown, as it may quote the password)",
                                parse_problem(msg));
        } else {
                char why[200];
                rc = check_values(opts, why, sizeof why);
                if (rc != 0)
                        errstr_set(errstr, errstr_size, "libpq would refuse it: %s", why);
        }
        PQfreemem(msg);
        PQconninfoFree(opts);
        return rc;
}

/* Appends `v` as a keyword/value value: bare when it can be, else in single
 * quotes with \ and ' escaped (libpq's rules). */
static void append_value(char *out, size_t size, size_t *o, const char *v) {
        int bare = *v != '\0';
        for (const char *p = v; *p && bare; p++)
                if (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r' || *p == '\f' ||
                    *p == '\v' || *p == '\'' || *p == '\\')
                        bare = 0;
        if (!bare && *o + 1 < size)
                out[(*o)++] = '\'';
        for (const char *p = v; *p && *o + 2 < size; p++) {
                if (!bare && (*p == '\'' || *p == '\\'))
                        out[(*o)++] = '\\';
                out[(*o)++] = *p;
        }
        if (!bare && *o + 1 < size)
                out[(*o)++] = '\'';
        out[*o] = '\0';
}

void db_conninfo_redact(const char *conninfo, char *out, size_t out_size) {
        char *msg = NULL;
        PQconninfoOption *opts = parse(conninfo ? conninfo : "", &msg);
        size_t o = 0;
        if (!out_size)
                goto done;
        out[0] = '\0';
        if (!opts) {
                snprintf(out, out_size, "(not a valid connection string)");
                goto done;
        }
        for (const PQconninfoOption *p = opts; p->keyword && o + 1 < out_size; p++) {
                if (!p->val)
                        continue;
                int secret = p->dispchar && p->dispchar[0] == '*';
                int n = snprintf(out + o, out_size - o, "%s%s=", o ? " " : "", p->keyword);
                if (n < 0 || (size_t)n >= out_size - o) {
                        out[o] = '\0';
                        break;
                }
                o += (size_t)n;
                append_value(out, out_size, &o, secret ? HIDDEN : p->val);
        }
done:
        PQfreemem(msg);
        PQconninfoFree(opts);
}

void db_conninfo_scrub(const char *conninfo, char *text) {
        char *msg = NULL;
        PQconninfoOption *opts = parse(conninfo ? conninfo : "", &msg);
        for (const PQconninfoOption *p = opts; p && p->keyword; p++) {
                if (!p->val || !*p->val || !p->dispchar || p->dispchar[0] != '*')
                        continue;
                size_t vl = strlen(p->val), hl = strlen(HIDDEN);
                for (char *at = strstr(text, p->val); at; at = strstr(at, p->val)) {
                        if (vl >= hl) {
                                memcpy(at, HIDDEN, hl);
                                memmove(at + hl, at + vl, strlen(at + vl) + 1);
                                at += hl;
                        } else {
                                memset(at, '*', vl); /* no room to grow: as many stars */
                                at += vl;
                        }
                }
        }
        PQfreemem(msg);
        PQconninfoFree(opts);
}
