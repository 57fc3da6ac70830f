/* fuzz_conninfo.c - OUTBOX_DATABASE_URL handling (common/db_conninfo.c): the
 * check, the redacted form and the scrub, on arbitrary strings. Checked:
 * a password given in a URI's userinfo never shows, in the error or in the
 * redacted form; the redacted form of an accepted string is accepted too and
 * redacts to itself (its quoting is libpq's). */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "db_conninfo.h"

#define MARK "XQZsecretXQZ"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        if (size > 16 * 1024)
                return 0;
        size_t cap = 2 * size + 256;
        char *in = malloc(size + 1), *uri = malloc(size + 64), *shown = malloc(cap),
             *again = malloc(cap), *text = malloc(size + 64);
        char err[512];
        memcpy(in, data, size);
        in[size] = '\0';

        int ok = db_conninfo_check(in, err, sizeof err) == 0;
        db_conninfo_redact(in, shown, cap);
        if (ok) {
                if (db_conninfo_check(shown, err, sizeof err) != 0)
                        abort(); /* the shown form of an accepted string is refused */
                db_conninfo_redact(shown, again, cap);
                if (strcmp(shown, again) != 0)
                        abort(); /* the shown form is read differently */
        }
        snprintf(text, size + 64, "%s", in);
        db_conninfo_scrub(in, text);

        /* a password in the userinfo, then the input as host, path and query */
        snprintf(uri, size + 64, "postgresql://u:" MARK "@%s", in);
        if (!strstr(in, MARK)) {
                int uri_ok = db_conninfo_check(uri, err, sizeof err) == 0;
                if (!uri_ok && strstr(err, MARK))
                        abort();
                db_conninfo_redact(uri, shown, cap);
                if (strstr(shown, MARK))
                        abort();
                snprintf(text, size + 64, "x" MARK "y");
                db_conninfo_scrub(uri, text);
                if (uri_ok && strstr(text, MARK) && !strstr(in, "password") && !strchr(in, '%'))
                        abort(); /* the userinfo password is the password */
        }
        free(in);
        free(uri);
        free(shown);
        free(again);
        free(text);
        return 0;
}
