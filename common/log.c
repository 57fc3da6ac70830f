/* log.c - the only module that writes to stderr.
 *
 * log_write() walks its printf-style `fields` format itself instead of
 * handing it to vsnprintf: the keys are the literal text the code wrote, and
 * each value (literal text and conversions up to the next space) is formatted
 * apart and then escaped. Row data (topics, ids, librdkafka's and PostgreSQL's
 * messages quoting them) therefore cannot add a field, a key or a line, and a
 * long value is cut by itself without losing the fields after it. */
#include "log.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>

#define KEY_MAX 64
#define CUT     "..."

static _Atomic int threshold = LOG_INFO;
static int as_json = 0;
static pthread_mutex_t out_lock = PTHREAD_MUTEX_INITIALIZER;

static const char *const level_names[] = {"debug", "info", "warn", "error"};

void log_setup(enum log_level level, int json) {
        threshold = (int)level;
        as_json = json;
}

void log_setup_level(enum log_level level) {
        threshold = (int)level;
}

int log_enabled(enum log_level level) {
        return (int)level >= threshold;
}

/* The line being built; `cap` keeps room for the closing "}\n" and a NUL. */
struct line {
        char *p;
        size_t len, cap;
};

static int put(struct line *l, const char *s, size_t n) {
        if (n > l->cap - l->len)
                return -1;
        memcpy(l->p + l->len, s, n);
        l->len += n;
        return 0;
}

/* One value's text before escaping: at most LOG_VALUE_MAX bytes are kept
 * (escaping never makes text shorter), `cut` says more was given. */
struct raw {
        char s[LOG_VALUE_MAX + 1];
        size_t len;
        int cut;
};

static void raw_add(struct raw *r, const char *s, size_t n) {
        size_t room = LOG_VALUE_MAX - r->len;
        if (n > room) {
                n = room;
                r->cut = 1;
        }
        memcpy(r->s + r->len, s, n);
        r->len += n;
}

/* Length of the valid UTF-8 character at s (n bytes left), its code point in
 * *cp; 0 when the bytes are not valid UTF-8 or the character is cut short. */
static size_t utf8_len(const unsigned char *s, size_t n, uint32_t *cp) {
        size_t len;
        uint32_t v, min;
        if (s[0] < 0x80) {
                *cp = s[0];
                return 1;
        }
        if (s[0] >= 0xC2 && s[0] <= 0xDF) {
                len = 2, v = s[0] & 0x1Fu, min = 0x80;
        } else if ((s[0] & 0xF0) == 0xE0) {
                len = 3, v = s[0] & 0x0Fu, min = 0x800;
        } else if (s[0] >= 0xF0 && s[0] <= 0xF4) {
                len = 4, v = s[0] & 0x07u, min = 0x10000;
        } else {
                return 0;
        }
        if (n < len)
                return 0;
        for (size_t i = 1; i < len; i++) {
                if ((s[i] & 0xC0) != 0x80)
                        return 0;
                v = v << 6 | (s[i] & 0x3Fu);
        }
        if (v < min || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF))
                return 0;
        *cp = v;
        return len;
}

/* A cut value may end inside a character: drops that partial character. */
static size_t trim_partial(const unsigned char *s, size_t n) {
        for (size_t back = 1; back <= 3 && back <= n; back++) {
                unsigned char c = s[n - back];
                if ((c & 0xC0) == 0x80)
                        continue; /* continuation byte: look further back */
                size_t want = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
                return want > back ? n - back : n;
        }
        return n;
}

/* Writes the escaped form of the character at s into esc and returns its
 * length; *used gets the bytes it stands for. The escapes are JSON's, and
 * the same inside logfmt quotes: quote, backslash, every control character
 * (C0, DEL, C1), U+2028/U+2029 (line breaks to some readers) and invalid
 * UTF-8 (as U+FFFD). */
static size_t escape_char(const unsigned char *s, size_t n, char esc[8], size_t *used) {
        uint32_t cp;
        size_t len = utf8_len(s, n, &cp);
        *used = len ? len : 1;
        if (!len)
                cp = 0xFFFD;
        switch (cp) {
        case '"': memcpy(esc, "\\\"", 2); return 2;
        case '\\': memcpy(esc, "\\\\", 2); return 2;
        case '\n': memcpy(esc, "\\n", 2); return 2;
        case '\r': memcpy(esc, "\\r", 2); return 2;
        case '\t': memcpy(esc, "\\t", 2); return 2;
        default: break;
        }
        if (cp < 0x20 || (cp >= 0x7F && cp <= 0x9F) || cp == 0x2028 || cp == 0x2029 || !len) {
                static const char hex[] = "0123456789abcdef";
                esc[0] = '\\', esc[1] = 'u';
                for (int i = 0; i < 4; i++)
                        esc[2 + i] = hex[(cp >> (12 - 4 * i)) & 15];
                return 6;
        }
        memcpy(esc, s, len);
        return len;
}

/* Nonzero when a logfmt value must be quoted: empty, or anything but
 * printable ASCII other than '"', '=' and '\'. */
static int needs_quotes(const unsigned char *s, size_t n) {
        if (n == 0)
                return 1;
        for (size_t i = 0; i < n; i++)
                if (s[i] <= ' ' || s[i] >= 0x7F || s[i] == '"' || s[i] == '=' || s[i] == '\\')
                        return 1;
        return 0;
}

/* Appends s (n bytes; `cut` when the text was already shortened) as a value:
 * a JSON string, or a logfmt value, quoted when needed or when `quote`. At
 * most LOG_VALUE_MAX bytes of escaped text; a longer value ends in "...".
 * -1 (line unchanged) when it does not fit. */
static int put_value(struct line *l, const char *s, size_t n, int cut, int json, int quote) {
        const unsigned char *u = (const unsigned char *)s;
        size_t start = l->len;
        if (cut)
                n = trim_partial(u, n);
        quote = quote || json || needs_quotes(u, n);
        if (quote && put(l, "\"", 1) != 0)
                return -1;
        size_t base = l->len, fits_cut = base;
        for (size_t i = 0; i < n;) {
                char esc[8];
                size_t used, el = escape_char(u + i, n - i, esc, &used);
                if (l->len - base + el > LOG_VALUE_MAX) {
                        cut = 1;
                        break;
                }
                if (put(l, esc, el) != 0)
                        goto undo;
                if (l->len - base <= LOG_VALUE_MAX - strlen(CUT))
                        fits_cut = l->len;
                i += used;
        }
        if (cut) {
                l->len = fits_cut;
                if (put(l, CUT, strlen(CUT)) != 0)
                        goto undo;
        }
        if (quote && put(l, "\"", 1) != 0)
                goto undo;
        return 0;
undo:
        l->len = start;
        return -1;
}

static int put_str(struct line *l, const char *s, int json, int quote) {
        size_t n = s ? strlen(s) : 0;
        return put_value(l, s ? s : "", n > LOG_VALUE_MAX ? LOG_VALUE_MAX : n, n > LOG_VALUE_MAX,
                         json, quote);
}

/* Formats the conversion at f (just past its '%') with its argument from ap,
 * appends the output to r and returns the format past the conversion. Every
 * conversion C11 printf knows takes its argument of the type it names, so ap
 * stays in step; %n writes nothing. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wformat-nonliteral" /* spec is rebuilt from a checked format */
static const char *convert(const char *f, va_list *ap, struct raw *r) {
        char spec[48];
        size_t sl = 0;
        spec[sl++] = '%';
        while (*f && strchr("-+ #0", *f)) {
                if (sl < 10)
                        spec[sl++] = *f;
                f++;
        }
        if (*f == '*') {
                int w = va_arg(*ap, int);
                sl += (size_t)snprintf(spec + sl, 8, "%d",
                                       w < -LOG_VALUE_MAX  ? -LOG_VALUE_MAX
                                       : w > LOG_VALUE_MAX ? LOG_VALUE_MAX
                                                           : w);
                f++;
        } else {
                for (int d = 0; *f >= '0' && *f <= '9'; f++)
                        if (d++ < 4)
                                spec[sl++] = *f;
        }
        if (*f == '.') {
                f++;
                if (*f == '*') {
                        int p = va_arg(*ap, int);
                        if (p >= 0)
                                sl += (size_t)snprintf(spec + sl, 8, ".%d",
                                                       p > LOG_VALUE_MAX ? LOG_VALUE_MAX : p);
                        f++;
                } else {
                        spec[sl++] = '.';
                        for (int d = 0; *f >= '0' && *f <= '9'; f++)
                                if (d++ < 4)
                                        spec[sl++] = *f;
                }
        }
        char len[3] = "";
        if ((f[0] == 'h' && f[1] == 'h') || (f[0] == 'l' && f[1] == 'l')) {
                len[0] = f[0], len[1] = f[1];
                f += 2;
        } else if (*f && strchr("hljztL", *f)) {
                len[0] = *f++;
        }
        char conv = *f;
        if (!conv) {
                raw_add(r, "%", 1); /* a lone '%' at the end */
                return f;
        }
        f++;
        memcpy(spec + sl, len, strlen(len));
        sl += strlen(len);
        spec[sl++] = conv;
        spec[sl] = '\0';

        char *out = r->s + r->len;
        size_t room = LOG_VALUE_MAX + 1 - r->len;
        int n = -1;
        switch (conv) {
        case 'd':
        case 'i':
                if (!strcmp(len, "l"))
                        n = snprintf(out, room, spec, va_arg(*ap, long));
                else if (!strcmp(len, "ll"))
                        n = snprintf(out, room, spec, va_arg(*ap, long long));
                else if (!strcmp(len, "j"))
                        n = snprintf(out, room, spec, va_arg(*ap, intmax_t));
                else if (!strcmp(len, "z"))
                        n = snprintf(out, room, spec, va_arg(*ap, ssize_t));
                else if (!strcmp(len, "t"))
                        n = snprintf(out, room, spec, va_arg(*ap, ptrdiff_t));
                else
                        n = snprintf(out, room, spec, va_arg(*ap, int));
                break;
        case 'u':
        case 'o':
        case 'x':
        case 'X':
                if (!strcmp(len, "l"))
                        n = snprintf(out, room, spec, va_arg(*ap, unsigned long));
                else if (!strcmp(len, "ll"))
                        n = snprintf(out, room, spec, va_arg(*ap, unsigned long long));
                else if (!strcmp(len, "j"))
                        n = snprintf(out, room, spec, va_arg(*ap, uintmax_t));
                else if (!strcmp(len, "z"))
                        n = snprintf(out, room, spec, va_arg(*ap, size_t));
                else if (!strcmp(len, "t"))
                        n = snprintf(out, room, spec, va_arg(*ap, ptrdiff_t));
                else
                        n = snprintf(out, room, spec, va_arg(*ap, unsigned));
                break;
        case 'f':
        case 'F':
        case 'e':
        case 'E':
        case 'g':
        case 'G':
        case 'a':
        case 'A':
                if (!strcmp(len, "L"))
                        n = snprintf(out, room, spec, va_arg(*ap, long double));
                else
                        n = snprintf(out, room, spec, va_arg(*ap, double));
                break;
        case 'c': n = snprintf(out, room, spec, va_arg(*ap, int)); break;
        case 's': {
                const char *s = va_arg(*ap, const char *);
                n = snprintf(out, room, spec, s ? s : "(null)");
                break;
        }
        case 'p': n = snprintf(out, room, spec, va_arg(*ap, void *)); break;
        case 'n': (void)va_arg(*ap, void *); return f;
        case '%': raw_add(r, "%", 1); return f;
        default: raw_add(r, spec, sl); return f; /* not a conversion: as written */
        }
        if (n < 0)
                return f;
        if ((size_t)n >= room) {
                r->len = LOG_VALUE_MAX;
                r->cut = 1;
        } else {
                r->len += (size_t)n;
        }
        return f;
}
#pragma GCC diagnostic pop

/* Appends the fields of format f, one at a time (see log_write()). */
static void put_fields(struct line *l, int json, const char *f, va_list *ap) {
        while (*f) {
                if (*f == ' ') {
                        f++;
                        continue;
                }
                char key[KEY_MAX + 1];
                size_t kl = 0;
                const char *k = f;
                while (*f && *f != ' ' && *f != '=' && *f != '%')
                        f++;
                if (*f == '=') {
                        for (; k < f && kl < KEY_MAX; k++) {
                                char c = *k;
                                int ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                                         (c >= '0' && c <= '9') || c == '_' || c == '.' || c == '-';
                                key[kl++] = ok ? c : '_';
                        }
                        f++;
                } else {
                        f = k; /* no literal key: the whole token is a value */
                }
                if (!kl)
                        key[kl++] = '_';
                key[kl] = '\0';

                struct raw r;
                r.len = 0;
                r.cut = 0;
                while (*f && *f != ' ') {
                        if (*f == '%') {
                                f = convert(f + 1, ap, &r);
                        } else {
                                const char *lit = f;
                                while (*f && *f != ' ' && *f != '%')
                                        f++;
                                raw_add(&r, lit, (size_t)(f - lit));
                        }
                }

                size_t start = l->len;
                int rc = json ? put(l, ",\"", 2) || put(l, key, kl) || put(l, "\":", 2)
                              : put(l, " ", 1) || put(l, key, kl) || put(l, "=", 1);
                if (rc || put_value(l, r.s, r.len, r.cut, json, 0) != 0)
                        l->len = start; /* no room: the field is left out whole */
        }
}

static size_t format_line(char *buf, size_t cap, int json, enum log_level level, const char *mod,
                          const char *msg, const char *fields, va_list *ap) {
        if (cap < 3) {
                if (cap)
                        buf[0] = '\0';
                return 0;
        }
        struct line l = {buf, 0, cap - 3}; /* room for "}\n" and the NUL */
        struct timespec ts;
        struct tm tm;
        char tbuf[64];
        clock_gettime(CLOCK_REALTIME, &ts);
        gmtime_r(&ts.tv_sec, &tm);
        size_t tl = strftime(tbuf, sizeof tbuf, "%Y-%m-%dT%H:%M:%S", &tm);
        snprintf(tbuf + tl, sizeof tbuf - tl, ".%03ldZ", ts.tv_nsec / 1000000);
        const char *lv = level_names[level >= LOG_DEBUG && level <= LOG_ERROR ? level : LOG_ERROR];

        int rc;
        if (json) {
                rc = put(&l, "{\"ts\":\"", 7) || put(&l, tbuf, strlen(tbuf)) ||
                     put(&l, "\",\"level\":\"", 11) || put(&l, lv, strlen(lv)) ||
                     put(&l, "\",\"mod\":", 8) || put_str(&l, mod, 1, 1) ||
                     put(&l, ",\"msg\":", 7) || put_str(&l, msg, 1, 1);
        } else {
                rc = put(&l, "ts=", 3) || put(&l, tbuf, strlen(tbuf)) || put(&l, " level=", 7) ||
                     put(&l, lv, strlen(lv)) || put(&l, " mod=", 5) || put_str(&l, mod, 0, 0) ||
                     put(&l, " msg=", 5) || put_str(&l, msg, 0, 1);
        }
        if (rc) {
                buf[0] = '\0';
                return 0;
        }
        if (fields)
                put_fields(&l, json, fields, ap);
        if (json)
                buf[l.len++] = '}';
        buf[l.len++] = '\n';
        buf[l.len] = '\0';
        return l.len;
}

size_t log_format(char *line, size_t cap, int json, enum log_level level, const char *mod,
                  const char *msg, const char *fields, ...) {
        va_list ap;
        va_start(ap, fields);
        size_t n = format_line(line, cap, json, level, mod, msg, fields, &ap);
        va_end(ap);
        return n;
}

void log_write(enum log_level level, const char *mod, const char *msg, const char *fields, ...) {
        if (!log_enabled(level))
                return;
        static __thread char line[LOG_LINE_MAX];
        va_list ap;
        va_start(ap, fields);
        size_t n = format_line(line, sizeof line, as_json, level, mod, msg, fields, &ap);
        va_end(ap);

        pthread_mutex_lock(&out_lock);
        fwrite(line, 1, n, stderr);
        fflush(stderr);
        pthread_mutex_unlock(&out_lock);
}

void log_plain(const char *text) {
        static __thread char line[LOG_LINE_MAX];
        const unsigned char *s = (const unsigned char *)text;
        size_t n = strlen(text), o = 0;
        for (size_t i = 0; i < n && o + 8 < sizeof line;) {
                char esc[8];
                size_t used, len = 1;
                if (s[i] == '"' || s[i] == '\\')
                        esc[0] = (char)s[i], used = 1;
                else
                        len = escape_char(s + i, n - i, esc, &used);
                memcpy(line + o, esc, len);
                o += len;
                i += used;
        }
        line[o++] = '\n';
        pthread_mutex_lock(&out_lock);
        fwrite(line, 1, o, stderr);
        fflush(stderr);
        pthread_mutex_unlock(&out_lock);
}
