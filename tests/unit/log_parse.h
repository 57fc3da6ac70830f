/* log_parse.h - a strict reader of the lines common/log.c writes, for the
 * unit tests and the log writer's fuzz target: a line is well-formed when it
 * is one JSON object of string members (json) or space-separated key=value
 * pairs with bare or quoted values (text), valid UTF-8, without a control
 * character, ending in its only '\n'. Header-only (static inline functions). */
#ifndef OUTBOX_TESTS_LOG_PARSE_H
#define OUTBOX_TESTS_LOG_PARSE_H

#include <stddef.h>
#include <string.h>

#define LOG_PARSE_MAX_FIELDS 48
#define LOG_PARSE_KEY_MAX    80
#define LOG_PARSE_VALUE_MAX  8192

struct log_parsed {
        size_t n;
        char key[LOG_PARSE_MAX_FIELDS][LOG_PARSE_KEY_MAX];
        char value[LOG_PARSE_MAX_FIELDS][LOG_PARSE_VALUE_MAX]; /* unescaped */
        size_t value_len[LOG_PARSE_MAX_FIELDS];
};

/* Length of the valid UTF-8 character at s (n bytes left), 0 if invalid. */
static inline size_t lp_utf8(const unsigned char *s, size_t n) {
        size_t len;
        unsigned v, min;
        if (s[0] < 0x80)
                return 1;
        if (s[0] >= 0xC2 && s[0] <= 0xDF)
                len = 2, v = s[0] & 0x1Fu, min = 0x80;
        else if ((s[0] & 0xF0) == 0xE0)
                len = 3, v = s[0] & 0x0Fu, min = 0x800;
        else if (s[0] >= 0xF0 && s[0] <= 0xF4)
                len = 4, v = s[0] & 0x07u, min = 0x10000;
        else
                return 0;
        if (n < len)
                return 0;
        for (size_t i = 1; i < len; i++) {
                if ((s[i] & 0xC0) != 0x80)
                        return 0;
                v = v << 6 | (s[i] & 0x3Fu);
        }
        return v < min || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF) ? 0 : len;
}

static inline int lp_hex(char c) {
        return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

/* Appends code point cp as UTF-8 to out (len *o, capacity cap). */
static inline void lp_put_cp(char *out, size_t cap, size_t *o, unsigned cp) {
        char b[4];
        size_t n;
        if (cp < 0x80)
                b[0] = (char)cp, n = 1;
        else if (cp < 0x800)
                b[0] = (char)(0xC0 | cp >> 6), b[1] = (char)(0x80 | (cp & 63)), n = 2;
        else
                b[0] = (char)(0xE0 | cp >> 12), b[1] = (char)(0x80 | ((cp >> 6) & 63)),
                b[2] = (char)(0x80 | (cp & 63)), n = 3;
        for (size_t i = 0; i < n && *o + 1 < cap; i++)
                out[(*o)++] = b[i];
}

/* Reads a quoted string at *p (end e), unescaping into out. 0 on success. */
static inline int lp_quoted(const char **p, const char *e, char *out, size_t cap, size_t *olen) {
        const char *s = *p;
        size_t o = 0;
        if (s >= e || *s++ != '"')
                return -1;
        while (s < e && *s != '"') {
                unsigned char c = (unsigned char)*s;
                if (c < 0x20 || c == 0x7F)
                        return -1;
                if (c == '\\') {
                        if (++s >= e)
                                return -1;
                        const char *simple = "\"\\/bfnrt", *unesc = "\"\\/\b\f\n\r\t";
                        const char *m = *s ? strchr(simple, *s) : NULL;
                        if (m) {
                                if (o + 1 < cap)
                                        out[o++] = unesc[m - simple];
                                s++;
                                continue;
                        }
                        if (*s != 'u' || e - s < 5)
                                return -1;
                        unsigned cp = 0;
                        for (int i = 1; i <= 4; i++) {
                                int h = lp_hex(s[i]);
                                if (h < 0)
                                        return -1;
                                cp = cp << 4 | (unsigned)h;
                        }
                        if (cp >= 0xD800 && cp <= 0xDFFF)
                                return -1; /* the writer never splits surrogates */
                        lp_put_cp(out, cap, &o, cp);
                        s += 5;
                        continue;
                }
                size_t n = lp_utf8((const unsigned char *)s, (size_t)(e - s));
                if (!n)
                        return -1;
                /* C1 controls and line separators are always escaped */
                if ((n == 2 && (unsigned char)s[0] == 0xC2 && (unsigned char)s[1] < 0xA0) ||
                    (n == 3 && (unsigned char)s[0] == 0xE2 && (unsigned char)s[1] == 0x80 &&
                     ((unsigned char)s[2] == 0xA8 || (unsigned char)s[2] == 0xA9)))
                        return -1;
                for (size_t i = 0; i < n; i++)
                        if (o + 1 < cap)
                                out[o++] = s[i];
                s += n;
        }
        if (s >= e)
                return -1;
        *p = s + 1;
        out[o] = '\0';
        *olen = o;
        return 0;
}

static inline int lp_key_char(char c) {
        return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
               c == '_' || c == '.' || c == '-';
}

/* 0 when line (n bytes) is one well-formed line; fills *out. */
static inline int log_parse_line(const char *line, size_t n, int json, struct log_parsed *out) {
        out->n = 0;
        if (n == 0 || line[n - 1] != '\n' || memchr(line, '\n', n - 1))
                return -1;
        const char *p = line, *e = line + n - 1;
        if (json) {
                if (p >= e || *p++ != '{')
                        return -1;
                for (;;) {
                        if (out->n == LOG_PARSE_MAX_FIELDS)
                                return -1;
                        size_t kl, i = out->n;
                        if (lp_quoted(&p, e, out->key[i], sizeof out->key[i], &kl) != 0 || p >= e ||
                            *p++ != ':' ||
                            lp_quoted(&p, e, out->value[i], sizeof out->value[i],
                                      &out->value_len[i]) != 0)
                                return -1;
                        out->n++;
                        if (p < e && *p == ',') {
                                p++;
                                continue;
                        }
                        break;
                }
                return p < e && *p == '}' && p + 1 == e ? 0 : -1;
        }
        for (;;) {
                if (out->n == LOG_PARSE_MAX_FIELDS)
                        return -1;
                size_t i = out->n, kl = 0;
                while (p < e && lp_key_char(*p) && kl + 1 < sizeof out->key[i])
                        out->key[i][kl++] = *p++;
                out->key[i][kl] = '\0';
                if (!kl || p >= e || *p++ != '=')
                        return -1;
                if (p < e && *p == '"') {
                        if (lp_quoted(&p, e, out->value[i], sizeof out->value[i],
                                      &out->value_len[i]) != 0)
                                return -1;
                } else {
                        size_t vl = 0;
                        while (p < e && *p != ' ') {
                                unsigned char c = (unsigned char)*p;
                                if (c <= ' ' || c >= 0x7F || c == '"' || c == '=' || c == '\\')
                                        return -1;
                                if (vl + 1 < sizeof out->value[i])
                                        out->value[i][vl++] = *p;
                                p++;
                        }
                        if (!vl)
                                return -1; /* an empty value is always quoted */
                        out->value[i][vl] = '\0';
                        out->value_len[i] = vl;
                }
                out->n++;
                if (p == e)
                        return 0;
                if (*p++ != ' ')
                        return -1;
        }
}

/* The index of key k in *lp, or -1. */
static inline int log_parsed_find(const struct log_parsed *lp, const char *k) {
        for (size_t i = 0; i < lp->n; i++)
                if (!strcmp(lp->key[i], k))
                        return (int)i;
        return -1;
}

#endif
