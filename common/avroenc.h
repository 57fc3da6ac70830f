/* avroenc.h - the Avro form of a row's value (OUTBOX_SERIALIZATION=avro), with
 * avro-c. Encoding only: the schema registry client is registry.h.
 *
 * Functions are prefixed avroenc_ because avro_ is avro-c's own namespace
 * (it already exports avro_codec_*). This header includes no avro-c header.
 *
 * Value schemas:
 *  - OUTBOX_VALUE_FORMAT=envelope: schemas/avro/outbox_envelope.avsc (compiled
 *    in), with each OUTBOX_ENVELOPE_FIELDS field appended as
 *    {"name": N, "type": ["null", "string"], "default": null}. payload is the
 *    payload_json column as JSON text (an Avro string), as Debezium's
 *    expand.json.payload=false.
 *  - OUTBOX_VALUE_FORMAT=payload: the Avro schema "string" holding the payload
 *    JSON text.
 * Framing: Avro single-object encoding (C3 01, the 8-byte little-endian
 * CRC-64-AVRO fingerprint of the schema's Parsing Canonical Form, the datum)
 * without a registry, or the Confluent wire format (00, 4-byte big-endian
 * schema id, the datum) with one. */
#ifndef OUTBOX_AVROENC_H
#define OUTBOX_AVROENC_H

#include <stddef.h>
#include <stdint.h>

#include "encode.h"
#include "event.h"

struct avroenc;

/* Builds the writer schema for `value_format` (enum config_value_format) and
 * `fields` (may be NULL; envelope only). NULL on failure (errstr says why). */
struct avroenc *avroenc_new(int value_format, const struct encode_fields *fields, char *errstr,
                            size_t errstr_size);

/* Frees everything. NULL is a no-op. */
void avroenc_destroy(struct avroenc *a);

/* The schema as JSON text (what is registered). Owned by `a`. */
const char *avroenc_schema_json(const struct avroenc *a);

/* The schema's Parsing Canonical Form. Owned by `a`. */
const char *avroenc_canonical_form(const struct avroenc *a);

/* CRC-64-AVRO of the canonical form (the single-object fingerprint). */
uint64_t avroenc_fingerprint(const struct avroenc *a);

/* avroenc_encode(): memory ran out (nothing about the event). */
#define AVROENC_NOMEM (-2)

/* Writes the framed value of ev (ev->payload must not be NULL: a tombstone has
 * no value) into out, replacing its content: single-object encoding when
 * schema_id < 0, else the Confluent wire format with that id. 0, or -1 (the
 * event cannot be encoded) or AVROENC_NOMEM, with errstr set. */
int avroenc_encode(struct avroenc *a, const struct outbox_event *ev, long long schema_id,
                   struct buf *out, char *errstr, size_t errstr_size)
        __attribute__((warn_unused_result));

/* CRC-64-AVRO (the Avro specification's Rabin fingerprint) of len bytes. */
uint64_t avroenc_crc64(const void *data, size_t len);

/* Parses Avro schema JSON and writes its Parsing Canonical Form into out
 * (replacing its content). 0, or -1 with errstr set. */
int avroenc_canonicalize(const char *schema_json, struct buf *out, char *errstr, size_t errstr_size)
        __attribute__((warn_unused_result));

#endif
