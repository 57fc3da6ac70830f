/* ctl_print.c - psql's aligned table format for outboxctl's listings, so
 * they read as they did when outboxctl ran psql, and the same results as
 * JSON. */
#include "ctl_print.h"

#include <stdlib.h>
#include <string.h>

/* Display width of a UTF-8 string: its code points. */
static size_t width(const char *s) {
        size_t w = 0;
        for (; s && *s; s++)
                w += ((unsigned char)*s & 0xC0) != 0x80;
        return w;
}

/* Writes s padded to w columns, left or right aligned; control characters
 * become spaces (one line per row). */
static void cell(FILE *out, const char *s, size_t w, int right) {
        size_t n = width(s);
        if (right)
                for (size_t i = n; i < w; i++)
                        fputc(' ', out);
        for (const char *p = s; p && *p; p++)
                fputc((unsigned char)*p < 0x20 || *p == 0x7f ? ' ' : *p, out);
        if (!right)
                for (size_t i = n; i < w; i++)
                        fputc(' ', out);
}

void ctl_print_table(FILE *out, const struct db_rows *r) {
        size_t *w = calloc((size_t)r->ncols + 1, sizeof *w);
        if (!w)
                return;
        for (int c = 0; c < r->ncols; c++) {
                w[c] = width(r->names[c]);
                for (int i = 0; i < r->nrows; i++) {
                        size_t n = width(r->cells[(size_t)i * (size_t)r->ncols + (size_t)c]);
                        if (n > w[c])
                                w[c] = n;
                }
        }
        /* header: names centred, as psql does */
        for (int c = 0; c < r->ncols; c++) {
                size_t n = width(r->names[c]), left = (w[c] - n) / 2;
                fprintf(out, "%s%*s%s%*s%s", c ? "|" : "", (int)left + 1, "", r->names[c],
                        (int)(w[c] - n - left), "", c + 1 < r->ncols ? " " : "");
        }
        fputc('\n', out);
        for (int c = 0; c < r->ncols; c++) {
                fputs(c ? "+" : "", out);
                for (size_t i = 0; i < w[c] + 2; i++)
                        fputc('-', out);
        }
        fputc('\n', out);
        for (int i = 0; i < r->nrows; i++) {
                for (int c = 0; c < r->ncols; c++) {
                        const char *v = r->cells[(size_t)i * (size_t)r->ncols + (size_t)c];
                        fputs(c ? "| " : " ", out);
                        /* the last column is not padded on the left-aligned side */
                        if (c + 1 == r->ncols && !r->numeric[c])
                                cell(out, v, 0, 0);
                        else
                                cell(out, v, w[c], r->numeric[c]);
                        if (c + 1 < r->ncols)
                                fputc(' ', out);
                }
                fputc('\n', out);
        }
        fprintf(out, "(%d row%s)\n\n", r->nrows, r->nrows == 1 ? "" : "s");
        free(w);
}

int ctl_json_rows(struct buf *b, const struct db_rows *r) {
        if (buf_append(b, "[", 1) != 0)
                return -1;
        for (int i = 0; i < r->nrows; i++) {
                if ((i && buf_append(b, ", ", 2) != 0) || buf_append(b, "{", 1) != 0)
                        return -1;
                for (int c = 0; c < r->ncols; c++) {
                        const char *v = r->cells[(size_t)i * (size_t)r->ncols + (size_t)c];
                        if ((c && buf_append(b, ", ", 2) != 0) ||
                            buf_append_json_string(b, r->names[c]) != 0 ||
                            buf_append(b, ": ", 2) != 0)
                                return -1;
                        int rc = v && r->numeric[c] ? buf_append(b, v, strlen(v))
                                                    : buf_append_json_string(b, v);
                        if (rc != 0)
                                return -1;
                }
                if (buf_append(b, "}", 1) != 0)
                        return -1;
        }
        return buf_append(b, "]", 1);
}

int ctl_json_column(struct buf *b, const struct db_rows *r, int col) {
        if (buf_append(b, "[", 1) != 0)
                return -1;
        for (int i = 0; col < r->ncols && i < r->nrows; i++)
                if ((i && buf_append(b, ", ", 2) != 0) ||
                    buf_append_json_string(
                            b, r->cells[(size_t)i * (size_t)r->ncols + (size_t)col]) != 0)
                        return -1;
        return buf_append(b, "]", 1);
}
