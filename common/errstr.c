/* errstr.c - one-line error messages for errstr buffers. */
#include "errstr.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

int errstr_set(char *errstr, size_t size, const char *fmt, ...) {
        va_list ap;
        if (!size)
                return -1;
        va_start(ap, fmt);
        vsnprintf(errstr, size, fmt, ap);
        va_end(ap);
        size_t n = strlen(errstr);
        while (n && (errstr[n - 1] == '\n' || errstr[n - 1] == ' '))
                errstr[--n] = '\0';
        for (char *p = errstr; *p; p++)
                if (*p == '\n')
                        *p = ' ';
        return -1;
}
