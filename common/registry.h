/* registry.h - Confluent schema registry client over libcurl (the only module
 * that includes curl). It knows nothing of Avro encoding (avroenc.h).
 *
 * registry_schema_id() registers (or finds: the call is idempotent on the
 * registry) a schema under a subject with POST <url>/subjects/<subject>/versions
 * {"schema": "<schema JSON text>"} -> {"id": N}, and caches the id per subject.
 * Without auto-registration it only looks the schema up, with POST
 * <url>/subjects/<subject> and the same body; a schema the subject does not
 * hold (HTTP 404) is REGISTRY_REJECTED.
 * Every failure is retriable for the relay: REGISTRY_UNAVAILABLE (transport
 * error, timeout, HTTP 5xx or 429) or REGISTRY_REJECTED (any other answer:
 * 4xx such as an incompatible schema, or a body without an id). After
 * REGISTRY_UNAVAILABLE further calls fail at once, without a request, for
 * REGISTRY_RETRY_MS, so a batch does not wait one timeout per row. */
#ifndef OUTBOX_REGISTRY_H
#define OUTBOX_REGISTRY_H

#include <stddef.h>

#define REGISTRY_TIMEOUT_MS         5000 /* whole request */
#define REGISTRY_CONNECT_TIMEOUT_MS 2000
#define REGISTRY_RETRY_MS           1000

struct registry;

/* Creates a client for base `url` (http:// or https://, userinfo allowed for
 * basic authentication; a trailing '/' is ignored) that registers schemas
 * (`auto_register` nonzero) or only looks them up. Does not connect. NULL on
 * failure (errstr says why). */
struct registry *registry_new(const char *url, int auto_register, char *errstr, size_t errstr_size);

/* Frees everything. NULL is a no-op. */
void registry_destroy(struct registry *reg);

/* Why registry_schema_id() failed. */
struct registry_error {
        const char *code; /* "REGISTRY_UNAVAILABLE" or "REGISTRY_REJECTED"; static */
        int unavailable;  /* REGISTRY_UNAVAILABLE: the registry could not answer, which
                           * says nothing about what was asked */
};

/* The id of `schema_json` under `subject`, from the cache or the registry.
 * 0 with *id set, or -1 with *why and errstr set (no credentials in it). A
 * given subject is assumed to be always asked with the same schema text; a
 * different text for a cached subject is looked up again and replaces the
 * entry. */
int registry_schema_id(struct registry *reg, const char *subject, const char *schema_json, int *id,
                       struct registry_error *why, char *errstr, size_t errstr_size)
        __attribute__((warn_unused_result));

/* Reads a registry's answer to the POST (HTTP `status`, `body` as received,
 * NUL-terminated): 0 with *id for a 200 holding an id, else -1 with *code
 * (REGISTRY_UNAVAILABLE for 5xx and 429, REGISTRY_REJECTED otherwise) and
 * the body's "message", if any, in msg (cut to msg_size). Used by
 * registry_schema_id(); public for the tests and the fuzz target. */
int registry_parse_reply(long status, const char *body, int *id, const char **code, char *msg,
                         size_t msg_size) __attribute__((warn_unused_result));

/* Requests sent so far (for tests of the cache). */
unsigned long registry_requests(const struct registry *reg);

#endif
