/* ctl_print.h - outboxctl's output on stdout: query results as psql prints
 * them (aligned, with a header and a row count), or as JSON. */
#ifndef OUTBOX_CTL_PRINT_H
#define OUTBOX_CTL_PRINT_H

#include <stdio.h>

#include "db_admin.h"
#include "encode.h"

/* Writes r as psql's aligned format: a header, a rule, the rows (numbers
 * right-aligned, NULL empty, control characters as spaces), then "(N rows)"
 * and a blank line. */
void ctl_print_table(FILE *out, const struct db_rows *r);

/* Appends r as a JSON array of objects keyed by column name (numbers as
 * numbers, NULL as null). 0 or -1 (out of memory). */
int ctl_json_rows(struct buf *b, const struct db_rows *r) __attribute__((warn_unused_result));

/* Appends column `col` of r as a JSON array of strings. 0 or -1. */
int ctl_json_column(struct buf *b, const struct db_rows *r, int col)
        __attribute__((warn_unused_result));

#endif
