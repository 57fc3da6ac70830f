/* log.c - the only module that writes to stderr. */
#include "log.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

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

const char *log_quote(const char *s) {
        static __thread char bufs[8][512];
        static __thread unsigned next;
        char *b = bufs[next++ % 8];
        size_t o = 0, cap = sizeof bufs[0];

        b[o++] = '"';
        for (; s && *s && o + 4 < cap; s++) {
                unsigned char c = (unsigned char)*s;
                if (c == '"' || c == '\\')
                        b[o++] = '\\';
                else if (c < 0x20)
                        c = ' ';
                b[o++] = (char)c;
        }
        b[o++] = '"';
        b[o] = '\0';
        return b;
}

/* Appends `s` (length n) as a JSON string body. */
static void json_append(char *out, size_t cap, size_t *o, const char *s, size_t n) {
        for (size_t i = 0; i < n && *o + 7 < cap; i++) {
                unsigned char c = (unsigned char)s[i];
                if (c == '"' || c == '\\') {
                        out[(*o)++] = '\\';
                        out[(*o)++] = (char)c;
                } else if (c < 0x20) {
                        *o += (size_t)snprintf(out + *o, cap - *o, "\\u%04x", c);
                } else {
                        out[(*o)++] = (char)c;
                }
        }
}

/* Turns our own logfmt fields (key=value, key="quoted \"value\"") into JSON
 * members appended to out. */
static void fields_to_json(const char *f, char *out, size_t cap, size_t *o) {
        while (*f) {
                while (*f == ' ')
                        f++;
                const char *key = f;
                while (*f && *f != '=' && *f != ' ')
                        f++;
                size_t klen = (size_t)(f - key);
                if (!klen)
                        break;
                if (*o + 8 >= cap)
                        return;
                out[(*o)++] = ',';
                out[(*o)++] = '"';
                json_append(out, cap, o, key, klen);
                out[(*o)++] = '"';
                out[(*o)++] = ':';
                out[(*o)++] = '"';
                if (*f == '=') {
                        f++;
                        if (*f == '"') {
                                f++;
                                while (*f && *f != '"') {
                                        if (*f == '\\' && f[1])
                                                f++;
                                        json_append(out, cap, o, f, 1);
                                        f++;
                                }
                                if (*f == '"')
                                        f++;
                        } else {
                                const char *v = f;
                                while (*f && *f != ' ')
                                        f++;
                                json_append(out, cap, o, v, (size_t)(f - v));
                        }
                }
                if (*o + 2 < cap)
                        out[(*o)++] = '"';
        }
}

void log_write(enum log_level level, const char *mod, const char *msg, const char *fields, ...) {
        if (!log_enabled(level))
                return;

        char fbuf[2048] = "";
        if (fields) {
                va_list ap;
                va_start(ap, fields);
                vsnprintf(fbuf, sizeof fbuf, fields, ap);
                va_end(ap);
        }

        struct timespec ts;
        struct tm tm;
        char tbuf[40];
        clock_gettime(CLOCK_REALTIME, &ts);
        gmtime_r(&ts.tv_sec, &tm);
        size_t tl = strftime(tbuf, sizeof tbuf, "%Y-%m-%dT%H:%M:%S", &tm);
        snprintf(tbuf + tl, sizeof tbuf - tl, ".%03ldZ", ts.tv_nsec / 1000000);

        char line[4096];
        size_t o = 0;
        if (as_json) {
                o += (size_t)snprintf(line, sizeof line,
                                      "{\"ts\":\"%s\",\"level\":\"%s\",\"mod\":\"", tbuf,
                                      level_names[level]);
                json_append(line, sizeof line, &o, mod, strlen(mod));
                o += (size_t)snprintf(line + o, sizeof line - o, "\",\"msg\":\"");
                json_append(line, sizeof line, &o, msg, strlen(msg));
                line[o++] = '"';
                fields_to_json(fbuf, line, sizeof line - 3, &o);
                line[o++] = '}';
        } else {
                o += (size_t)snprintf(line, sizeof line, "ts=%s level=%s mod=%s msg=%s%s%s", tbuf,
                                      level_names[level], mod, log_quote(msg), fbuf[0] ? " " : "",
                                      fbuf);
                if (o > sizeof line - 2)
                        o = sizeof line - 2;
        }
        line[o++] = '\n';

        pthread_mutex_lock(&out_lock);
        fwrite(line, 1, o, stderr);
        fflush(stderr);
        pthread_mutex_unlock(&out_lock);
}
