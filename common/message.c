/* message.c - one row as a Kafka message: encode.c's topic, envelope and
 * headers, avroenc.c's Avro value, registry.c's schema ids. */
#include "message.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "avroenc.h"
#include "registry.h"

struct message {
        const struct config *cfg;
        struct encode_fields fields; /* OUTBOX_ENVELOPE_FIELDS */
        struct avroenc *avro;        /* OUTBOX_SERIALIZATION=avro */
        struct registry *registry;   /* and OUTBOX_SCHEMA_REGISTRY_URL */
        /* the current message */
        struct buf topic, subject, value, scratch;
        char schema_id[16];
        struct encode_header hdrs[ENCODE_MAX_HEADERS];
};

struct message *message_new(const struct config *cfg, char *errstr, size_t errstr_size) {
        struct message *m = calloc(1, sizeof *m);
        if (!m) {
                snprintf(errstr, errstr_size, "out of memory");
                return NULL;
        }
        m->cfg = cfg;
        if (encode_fields_parse(cfg->envelope_fields, &m->fields, errstr, errstr_size) != 0)
                goto fail;
        if (cfg->serialization == SERIALIZATION_AVRO) {
                m->avro = avroenc_new(cfg->value_format, &m->fields, errstr, errstr_size);
                if (!m->avro)
                        goto fail;
                if (*cfg->schema_registry_url &&
                    !(m->registry = registry_new(cfg->schema_registry_url,
                                                 cfg->schema_registry_auto_register, errstr,
                                                 errstr_size)))
                        goto fail;
        }
        return m;
fail:
        message_destroy(m);
        return NULL;
}

void message_destroy(struct message *m) {
        if (!m)
                return;
        buf_free(&m->topic);
        buf_free(&m->subject);
        buf_free(&m->value);
        buf_free(&m->scratch);
        avroenc_destroy(m->avro);
        registry_destroy(m->registry);
        free(m);
}

int message_avro(const struct message *m, unsigned long long *fingerprint, int *registry) {
        if (!m->avro)
                return 0;
        *fingerprint = (unsigned long long)avroenc_fingerprint(m->avro);
        *registry = m->registry != NULL;
        return 1;
}

/* Fills *why; `text` NULL keeps the text already in it. Returns -1. */
static int fail(struct message_error *why, int permanent, const char *code, const char *text) {
        why->code = code;
        why->permanent = permanent;
        why->uncounted = 0;
        if (text)
                snprintf(why->text, sizeof why->text, "%s", text);
        return -1;
}

/* Memory ran out forming the message: that says nothing about the row, so
 * it is tried again and the attempt does not count. Returns -1. */
static int out_of_memory(struct message_error *why, const char *text) {
        fail(why, 0, "OUT_OF_MEMORY", text);
        why->uncounted = 1;
        return -1;
}

/* The schema id (subject <topic>-value) for the schema-id header and the
 * Confluent framing; -1 without a registry, and for a tombstone, which has
 * no value and so needs no schema. Every registry failure is retriable. */
static int schema_id(struct message *m, const struct outbox_event *ev, const char *topic, int *id,
                     struct message_error *why) {
        struct registry_error re;
        *id = -1;
        if (!m->registry || !ev->payload)
                return 0;
        buf_reset(&m->subject);
        if (buf_appendf(&m->subject, "%s-value", topic) != 0)
                return out_of_memory(why, "out of memory forming the schema subject");
        if (registry_schema_id(m->registry, m->subject.data, avroenc_schema_json(m->avro), id, &re,
                               why->text, sizeof why->text) != 0) {
                fail(why, 0, re.code, NULL);
                why->uncounted = re.unavailable;
                return -1;
        }
        snprintf(m->schema_id, sizeof m->schema_id, "%d", *id);
        return 0;
}

/* The value: Avro, the payload alone, or the JSON envelope; none for a
 * tombstone. */
static int value(struct message *m, const struct outbox_event *ev, int id,
                 struct message_parts *out, struct message_error *why) {
        if (!ev->payload)
                return 0;
        if (m->avro) {
                int rc = avroenc_encode(m->avro, ev, id, &m->value, why->text, sizeof why->text);
                if (rc == AVROENC_NOMEM)
                        return out_of_memory(why, NULL);
                if (rc != 0)
                        return fail(why, 1, "ENCODE_FAILED", NULL);
        } else if (m->cfg->value_format == VALUE_PAYLOAD) {
                out->value = ev->payload;
                out->value_len = ev->payload_len;
                return 0;
        } else if (encode_envelope_json_fields(ev, &m->fields, &m->value) != 0) {
                return out_of_memory(why, "out of memory encoding the envelope");
        }
        out->value = m->value.data;
        out->value_len = m->value.len;
        return 0;
}

int message_build(struct message *m, const struct outbox_event *ev, struct message_parts *out,
                  struct message_error *why) {
        const struct config *cfg = m->cfg;
        int id;
        memset(out, 0, sizeof *out);
        if (encode_topic(cfg->topic_template, ev, &m->topic) != 0)
                return out_of_memory(why, "out of memory forming the topic");
        out->topic = m->topic.data; /* named in the log line of the row's outcome */
        if (!encode_topic_is_legal(m->topic.data)) {
                snprintf(why->text, sizeof why->text,
                         "%s: topic '%.60s%s' (%zu bytes) is not a legal Kafka topic name "
                         "(1-%d of a-z A-Z 0-9 . _ -)",
                         encode_topic_column(cfg->topic_template, ev), m->topic.data,
                         m->topic.len > 60 ? "..." : "", m->topic.len, ENCODE_TOPIC_MAX);
                return fail(why, 1, "INVALID_VALUE", NULL);
        }
        if (schema_id(m, ev, out->topic, &id, why) != 0)
                return -1;
        int n = encode_headers_fields(ev, cfg->producer_name,
                                      m->avro ? "application/avro" : "application/json",
                                      id >= 0 ? m->schema_id : NULL, &m->fields, m->hdrs,
                                      &m->scratch, why->text, sizeof why->text);
        if (n == ENCODE_NOMEM)
                return out_of_memory(why, NULL);
        if (n < 0)
                return fail(why, 1, "INVALID_HEADERS", NULL);
        if (value(m, ev, id, out, why) != 0)
                return -1;
        out->key = ev->partition_key ? ev->partition_key : ev->aggregate_id;
        out->key_len = strlen(out->key);
        out->headers = m->hdrs;
        out->header_count = n;
        return 0;
}
