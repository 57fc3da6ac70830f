/* test_alloc.c - what the daemons' own code does when an allocation fails.
 * This binary is linked with malloc, calloc, realloc, strdup and strndup
 * wrapped (tests/CMakeLists.txt), so that every allocation the project's
 * code makes can be made to fail: each operation below runs once with no
 * failure, then once for each of its allocations with that one failing.
 * Whatever fails, the operation must not crash, must report the failure or
 * give exactly the output it gives without one (never a wrong result), and,
 * under AddressSanitizer, must leak nothing. Allocations the libraries make
 * inside themselves (jansson, avro-c, libpq, librdkafka) are not wrapped:
 * this covers the checks of the project's own code. (avro-c's could be,
 * through avro_set_allocator(), but avro-c itself dereferences a failed
 * allocation: in its schema parser and in avro_raw_string_set_length().) */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "encode.h"
#include "health.h"
#include "message.h"
#include "metrics.h"
#include "sample_event.h"

#if defined(__SANITIZE_ADDRESS__)
#define LEAK_CHECK 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define LEAK_CHECK 1
#endif
#endif
#ifdef LEAK_CHECK
#include <sanitizer/lsan_interface.h>
#endif

/* The allocation to fail (counted from 0), -1 for none; how many were made;
 * whether allocations count (not while the test formats what it got). */
static long fail_at = -1;
static long made;
static int counting;

static int fails(void) {
        return counting && made++ == fail_at;
}

void *__real_malloc(size_t n);
void *__real_calloc(size_t n, size_t size);
void *__real_realloc(void *p, size_t n);
char *__real_strdup(const char *s);
char *__real_strndup(const char *s, size_t n);

/* A failed allocation says ENOMEM, as glibc's does. */
static void *nomem(void) {
        errno = ENOMEM;
        return NULL;
}

void *__wrap_malloc(size_t n) {
        return fails() ? nomem() : __real_malloc(n);
}
void *__wrap_calloc(size_t n, size_t size) {
        return fails() ? nomem() : __real_calloc(n, size);
}
void *__wrap_realloc(void *p, size_t n) {
        return fails() ? nomem() : __real_realloc(p, n);
}
char *__wrap_strdup(const char *s) {
        return fails() ? nomem() : __real_strdup(s);
}
char *__wrap_strndup(const char *s, size_t n) {
        return fails() ? nomem() : __real_strndup(s, n);
}

/* One operation: 0 and its output in *out (malloc'd, or NULL for none), or
 * nonzero for a failure it reported. It frees everything else it made. */
typedef int (*operation)(char **out);

/* Runs op with no failure, then with each of its allocations failing in
 * turn; returns how many allocations it makes. */
static long every_failure(const char *name, operation op) {
        char *want = NULL, *got;
        made = 0;
        fail_at = -1;
        counting = 1;
        cr_assert_eq(op(&want), 0, "%s fails with no allocation failing", name);
        long total = made;
        cr_assert_gt(total, 0, "%s allocates nothing: nothing tested", name);
        for (long n = 0; n < total; n++) {
                got = NULL;
                made = 0;
                fail_at = n;
                counting = 1;
                int rc = op(&got);
                fail_at = -1;
                if (rc == 0)
                        cr_assert(want ? got && !strcmp(want, got) : !got,
                                  "%s: allocation %ld of %ld failed, and it answered success with "
                                  "another result:\n%s\ninstead of\n%s",
                                  name, n, total, got ? got : "(none)", want ? want : "(none)");
                free(got);
        }
        free(want);
#ifdef LEAK_CHECK
        cr_assert_eq(__lsan_do_recoverable_leak_check(), 0, "%s leaks after a failed allocation",
                     name);
#endif
        return total;
}

static char *copy(const void *p, size_t n) {
        char *s = __real_malloc(n + 1);
        cr_assert_not_null(s);
        memcpy(s, p, n);
        s[n] = '\0';
        return s;
}

static void environment(void) {
        clearenv();
        setenv("OUTBOX_DATABASE_URL", "postgresql://u:secret@h/db", 1);
        setenv("OUTBOX_KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092", 1);
        setenv("OUTBOX_KAFKA_LINGER_MS", "7", 1);
        setenv("OUTBOX_TOPIC_TEMPLATE", "{tenant_id}.{aggregate_type}", 1);
}

TestSuite(alloc, .init = environment, .timeout = 120);

static int load_config(char **out) {
        struct config cfg;
        char err[256];
        char *argv[] = {"outbox-relay", NULL};
        int rc = config_load(&cfg, CONFIG_RELAY, 1, argv, stdout, err, sizeof err);
        counting = 0;
        if (rc == 0) {
                char line[512];
                snprintf(line, sizeof line, "%s|%s|%d|%zu", cfg.topic_template, cfg.table,
                         cfg.batch_size, cfg.kafka_cnt);
                *out = copy(line, strlen(line));
        }
        config_destroy(&cfg);
        return rc;
}

Test(alloc, config_load) {
        every_failure("config_load", load_config);
}

/* The message of the sample event (topic, key, value and headers, as text)
 * under the configuration the environment gives. */
static int build_message(char **out) {
        struct config cfg;
        char err[256];
        char *argv[] = {"outbox-relay", NULL};
        counting = 0; /* the configuration is config_load's test */
        cr_assert_eq(config_load(&cfg, CONFIG_RELAY, 1, argv, stdout, err, sizeof err), 0, "%s",
                     err);
        counting = 1;
        int rc = -1;
        struct message *m = message_new(&cfg, err, sizeof err);
        cr_assert(m || fail_at >= 0, "%s", err);
        if (m) {
                struct outbox_event ev = sample_event();
                ev.headers = "6:tenant3:t-11:n1:3"; /* as the fetch decodes headers_json */
                struct message_parts p;
                struct message_error why;
                rc = message_build(m, &ev, &p, &why);
                counting = 0;
                cr_assert(rc == 0 || fail_at >= 0, "%s: %s", why.code, why.text);
                /* memory running out says nothing about the row: it is
                 * tried again, never DEAD for it */
                cr_assert(rc == 0 || (!why.permanent && why.uncounted &&
                                      !strcmp(why.code, "OUT_OF_MEMORY")),
                          "allocation %ld failed: %s (permanent %d, uncounted %d): %s", fail_at,
                          why.code, why.permanent, why.uncounted, why.text);
                if (rc == 0) {
                        struct buf b = {0};
                        int e = buf_appendf(&b, "%s|", p.topic);
                        e = e ? e : buf_append(&b, p.key ? p.key : "", p.key ? p.key_len : 0);
                        e = e ? e : buf_append(&b, "|", 1);
                        e = e ? e : buf_append(&b, p.value, p.value_len);
                        for (int i = 0; e == 0 && i < p.header_count; i++)
                                e = buf_appendf(&b, "|%s=%.*s", p.headers[i].name,
                                                (int)p.headers[i].value_len, p.headers[i].value);
                        cr_assert_eq(e, 0);
                        *out = copy(b.data, b.len);
                        buf_free(&b);
                }
        }
        message_destroy(m);
        config_destroy(&cfg);
        return rc;
}

Test(alloc, json_envelope) {
        every_failure("message (JSON envelope)", build_message);
}

Test(alloc, json_envelope_fields) {
        setenv("OUTBOX_ENVELOPE_FIELDS", "event_key,headers_json.tenant:tenant", 1);
        every_failure("message (envelope fields)", build_message);
}

Test(alloc, avro_envelope) {
        setenv("OUTBOX_SERIALIZATION", "avro", 1);
        every_failure("message (Avro envelope)", build_message);
}

static int render_metrics(char **out) {
        int rc = metrics_init("outbox-relay");
        if (rc == 0) {
                metrics_add2(M_STATEMENT_ERRORS, "lock", "57014", 1);
                metrics_set(M_EVENTS, "PENDING", 12);
                struct buf b = {0};
                rc = metrics_render(&b);
                counting = 0;
                if (rc == 0)
                        *out = copy(b.data, b.len);
                buf_free(&b);
        }
        metrics_destroy();
        return rc;
}

Test(alloc, metrics) {
        every_failure("metrics", render_metrics);
}

static int readyz(char **out) {
        static const char *const names[] = {"database", "kafka"};
        struct health *h = health_new(names, 2, 5.0);
        if (!h)
                return -1;
        health_set(h, 0, 0, "connection refused: %s", "h:5432");
        health_set(h, 1, 1, "%s", "connected");
        struct buf b = {0};
        int code = health_readyz(h, &b);
        counting = 0;
        int rc = code < 0 ? -1 : 0;
        if (rc == 0) {
                char head[16];
                snprintf(head, sizeof head, "%d|", code);
                struct buf all = {0};
                cr_assert_eq(buf_appendf(&all, "%s%s", head, b.data), 0);
                *out = copy(all.data, all.len);
                buf_free(&all);
        }
        buf_free(&b);
        health_destroy(h);
        return rc;
}

Test(alloc, readyz) {
        every_failure("readyz", readyz);
}
