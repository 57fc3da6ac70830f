/* errstr.h - filling the caller's error buffer (librdkafka style). */
#ifndef OUTBOX_ERRSTR_H
#define OUTBOX_ERRSTR_H

#include <stddef.h>

/* Formats into errstr as one line (newlines become spaces, trailing
 * whitespace is dropped: libpq's messages end in a newline) and returns -1,
 * so a fallible function can `return errstr_set(...)`. */
int errstr_set(char *errstr, size_t size, const char *fmt, ...)
        __attribute__((format(printf, 3, 4)));

#endif
