/* log.h - one line per event on stderr, logfmt ("text") or JSON. */
#ifndef OUTBOX_LOG_H
#define OUTBOX_LOG_H

enum log_level { LOG_DEBUG = 0, LOG_INFO, LOG_WARN, LOG_ERROR };

/* Sets the threshold and format; callable before and after other calls. */
void log_setup(enum log_level level, int json);

/* Changes the threshold only; safe while other threads log. */
void log_setup_level(enum log_level level);

/* Returns nonzero when a message at `level` would be written. */
int log_enabled(enum log_level level);

/* Writes `ts=... level=... mod=<mod> msg="<msg>" <fields>` (or the same as a
 * JSON object). `fields` is a printf format producing space-separated key=value
 * pairs; a value that may hold spaces or quotes must be passed through
 * log_quote(). `fields` may be NULL. Never pass payloads or passwords. */
void log_write(enum log_level level, const char *mod, const char *msg, const char *fields, ...)
        __attribute__((format(printf, 4, 5)));

/* Returns `s` as a logfmt quoted string ("..." with \" and \\ escaped, control
 * characters dropped) in one of 8 rotating thread-local buffers of 512 bytes:
 * valid until the 8th next call in the same thread. */
const char *log_quote(const char *s);

#define log_debug(mod, msg, ...)                                                                   \
        do {                                                                                       \
                if (log_enabled(LOG_DEBUG))                                                        \
                        log_write(LOG_DEBUG, mod, msg, __VA_ARGS__);                               \
        } while (0)
#define log_info(mod, msg, ...)  log_write(LOG_INFO, mod, msg, __VA_ARGS__)
#define log_warn(mod, msg, ...)  log_write(LOG_WARN, mod, msg, __VA_ARGS__)
#define log_error(mod, msg, ...) log_write(LOG_ERROR, mod, msg, __VA_ARGS__)

#endif
