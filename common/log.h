/* log.h - one line per event on stderr, logfmt ("text") or JSON. */
#ifndef OUTBOX_LOG_H
#define OUTBOX_LOG_H

#include <stddef.h>

enum log_level { LOG_DEBUG = 0, LOG_INFO, LOG_WARN, LOG_ERROR };

/* A value (or mod, or msg) longer than this, escaped, is cut and ends in
 * "..."; the fields after it are still written. */
#define LOG_VALUE_MAX 1024
/* The longest line log_write() writes, '\n' included. Fields that would not
 * fit are left out whole (no call in this code base comes near it). */
#define LOG_LINE_MAX 16384

/* Sets the threshold and format; callable before and after other calls. */
void log_setup(enum log_level level, int json);

/* Changes the threshold only; safe while other threads log. */
void log_setup_level(enum log_level level);

/* Returns nonzero when a message at `level` would be written. */
int log_enabled(enum log_level level);

/* Writes `ts=... level=... mod=<mod> msg="<msg>" <fields>` (or the same as a
 * JSON object) as one line. `fields` (may be NULL) is a printf format of
 * space-separated key=value pairs, e.g. "topic=%s rows=%zu". log_write walks
 * it itself: a key is the literal text before '=' (letters, digits, '_', '.'
 * and '-'; anything else is written as '_'), the value is everything up to the
 * next space in the format, conversions included, and is always escaped as a
 * value (logfmt quoting when needed, a JSON string, control characters,
 * invalid UTF-8 and line separators escaped). So no argument can add a field
 * or a line. Values are cut at LOG_VALUE_MAX. Never pass payloads or
 * passwords. */
void log_write(enum log_level level, const char *mod, const char *msg, const char *fields, ...)
        __attribute__((format(printf, 4, 5)));

/* Formats the line log_write() would write, '\n' included, into line (`cap`
 * bytes, NUL-terminated) in the given format (json nonzero: JSON) and returns
 * its length; no output, no level check. For tests and fuzzing. */
size_t log_format(char *line, size_t cap, int json, enum log_level level, const char *mod,
                  const char *msg, const char *fields, ...) __attribute__((format(printf, 7, 8)));

/* Writes `text` and a newline as it is, not as a log line: for a command-line
 * tool's usage errors, which a person reads. Control characters, line
 * separators and invalid UTF-8 are escaped as in a log value (so the text is
 * one line whatever it quotes); it is cut at LOG_LINE_MAX. Not gated by the
 * level. */
void log_plain(const char *text);

#define log_debug(mod, msg, ...)                                                                   \
        do {                                                                                       \
                if (log_enabled(LOG_DEBUG))                                                        \
                        log_write(LOG_DEBUG, mod, msg, __VA_ARGS__);                               \
        } while (0)
#define log_info(mod, msg, ...)  log_write(LOG_INFO, mod, msg, __VA_ARGS__)
#define log_warn(mod, msg, ...)  log_write(LOG_WARN, mod, msg, __VA_ARGS__)
#define log_error(mod, msg, ...) log_write(LOG_ERROR, mod, msg, __VA_ARGS__)

#endif
