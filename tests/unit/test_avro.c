/* Unit tests of avro: CRC-64-AVRO, canonical form, envelope schema, framing.
 * Expected values come from python3-avro 1.11.1 (canonical_form, DatumWriter)
 * and the Avro specification's fingerprint algorithm. */
#include <criterion/criterion.h>
#include <string.h>

#include "avroenc.h"
#include "config.h"
#include "sample_event.h"

static struct buf b;
static struct avroenc *a;
static char err[512];
static void fini(void) {
        buf_free(&b);
        avroenc_destroy(a);
        a = NULL;
}
TestSuite(avro, .fini = fini);

static const char envelope_canonical[] =
        "{\"name\":\"io.outboxrelay.OutboxEnvelope\",\"type\":\"record\",\"fields\":["
        "{\"name\":\"event_id\",\"type\":\"string\"},{\"name\":\"event_type\",\"type\":\"string\"},"
        "{\"name\":\"event_version\",\"type\":\"int\"},{\"name\":\"tenant_id\",\"type\":\"string\"}"
        ","
        "{\"name\":\"aggregate_type\",\"type\":\"string\"},"
        "{\"name\":\"aggregate_id\",\"type\":\"string\"},"
        "{\"name\":\"aggregate_version\",\"type\":\"long\"},"
        "{\"name\":\"occurred_at\",\"type\":\"string\"},"
        "{\"name\":\"correlation_id\",\"type\":[\"null\",\"string\"]},"
        "{\"name\":\"causation_id\",\"type\":[\"null\",\"string\"]},"
        "{\"name\":\"trace_id\",\"type\":[\"null\",\"string\"]},"
        "{\"name\":\"payload\",\"type\":\"string\"}]}";
#define ENVELOPE_FP 0x543dc759e1fc2871ULL

static struct outbox_event sample(void) {
        struct outbox_event ev = sample_event();
        ev.headers = "6:region2:eu";
        ev.causation_id = "c";
        return ev;
}

/* python3-avro's DatumWriter output for sample() with the envelope schema. */
static const char sample_datum_hex[] =
        "4830623866336632652d386135372d346333392d396130652d336331643261306636623131184f7264657243"
        "726561746564040861636d650a4f72646572066f2d310e36323032362d31312d32335430303a30303a3030"
        "2e3030303030315a00020263001e7b22746f74616c223a2031322e357d";

static void hex(const char *data, size_t len, char *out) {
        for (size_t i = 0; i < len; i++)
                sprintf(out + 2 * i, "%02x", (unsigned char)data[i]);
        out[2 * len] = '\0';
}

Test(avro, crc64_matches_the_specification) {
        /* the spec's fingerprint of "null" and of "int" */
        cr_assert_eq(avroenc_crc64("\"null\"", 6), 0x63dd24e7cc258f8aULL);
        cr_assert_eq(avroenc_crc64("\"int\"", 5), 0x7275d51a3f395c8fULL);
        cr_assert_eq(avroenc_crc64("", 0), 0xc15d213aa4d7a795ULL);
}

Test(avro, canonical_form_like_python_avro) {
        struct {
                const char *in, *want;
        } c[] = {
                {"\"null\"", "\"null\""},
                {"{\"type\":\"int\"}", "\"int\""},
                {"{\"type\":\"fixed\",\"name\":\"F\",\"namespace\":\"a.b\",\"size\":4,\"doc\":"
                 "\"x\"}",
                 "{\"name\":\"a.b.F\",\"type\":\"fixed\",\"size\":4}"},
                {"{\"type\":\"record\",\"name\":\"R\",\"fields\":[{\"name\":\"e\",\"type\":{"
                 "\"type\":"
                 "\"enum\",\"name\":\"E\",\"symbols\":[\"A\",\"B\"]}},{\"name\":\"m\",\"type\":{"
                 "\"type\":"
                 "\"map\",\"values\":{\"type\":\"array\",\"items\":\"long\"}}},{\"name\":\"r\","
                 "\"type\":"
                 "[\"null\",\"R\"]},{\"name\":\"e2\",\"type\":\"E\"}]}",
                 "{\"name\":\"R\",\"type\":\"record\",\"fields\":[{\"name\":\"e\",\"type\":{"
                 "\"name\":"
                 "\"E\",\"type\":\"enum\",\"symbols\":[\"A\",\"B\"]}},{\"name\":\"m\",\"type\":{"
                 "\"type\":"
                 "\"map\",\"values\":{\"type\":\"array\",\"items\":\"long\"}}},{\"name\":\"r\","
                 "\"type\":"
                 "[\"null\",\"R\"]},{\"name\":\"e2\",\"type\":\"E\"}]}"},
        };
        for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
                cr_assert_eq(avroenc_canonicalize(c[i].in, &b, err, sizeof err), 0, "%s", err);
                cr_assert_str_eq(b.data, c[i].want);
        }
        cr_assert_eq(avroenc_canonicalize("{\"type\":\"nope\"}", &b, err, sizeof err), -1);
        cr_assert(strstr(err, "bad Avro schema"), "%s", err);
}

Test(avro, envelope_schema_fingerprint) {
        a = avroenc_new(VALUE_ENVELOPE, NULL, err, sizeof err);
        cr_assert(a, "%s", err);
        cr_assert_str_eq(avroenc_canonical_form(a), envelope_canonical);
        cr_assert_eq(avroenc_fingerprint(a), ENVELOPE_FP);
        cr_assert(strstr(avroenc_schema_json(a), "\"default\": null"),
                  "the full schema is registered");
}

Test(avro, single_object_encoding) {
        a = avroenc_new(VALUE_ENVELOPE, NULL, err, sizeof err);
        cr_assert(a, "%s", err);
        struct outbox_event ev = sample();
        cr_assert_eq(avroenc_encode(a, &ev, -1, &b, err, sizeof err), 0, "%s", err);
        cr_assert_eq((unsigned char)b.data[0], 0xC3);
        cr_assert_eq((unsigned char)b.data[1], 0x01);
        unsigned long long fp = 0;
        for (int i = 0; i < 8; i++)
                fp |= (unsigned long long)(unsigned char)b.data[2 + i] << (8 * i);
        cr_assert_eq(fp, ENVELOPE_FP);
        char h[1024];
        cr_assert_eq(b.len - 10, (sizeof sample_datum_hex - 1) / 2);
        hex(b.data + 10, b.len - 10, h);
        cr_assert_str_eq(h, sample_datum_hex);
        /* the encoder is reused: a second row gives the same bytes */
        cr_assert_eq(avroenc_encode(a, &ev, -1, &b, err, sizeof err), 0, "%s", err);
        hex(b.data + 10, b.len - 10, h);
        cr_assert_str_eq(h, sample_datum_hex);
}

Test(avro, confluent_wire_format) {
        a = avroenc_new(VALUE_ENVELOPE, NULL, err, sizeof err);
        cr_assert(a, "%s", err);
        struct outbox_event ev = sample();
        cr_assert_eq(avroenc_encode(a, &ev, 0x01020304, &b, err, sizeof err), 0, "%s", err);
        const unsigned char want[] = {0, 1, 2, 3, 4};
        cr_assert_eq(memcmp(b.data, want, 5), 0);
        char h[1024];
        hex(b.data + 5, b.len - 5, h);
        cr_assert_str_eq(h, sample_datum_hex);
}

Test(avro, tombstone_has_no_value) {
        a = avroenc_new(VALUE_ENVELOPE, NULL, err, sizeof err);
        cr_assert(a);
        struct outbox_event ev = sample();
        ev.payload = NULL;
        cr_assert_eq(avroenc_encode(a, &ev, -1, &b, err, sizeof err), -1);
}

Test(avro, payload_value_format_is_an_avro_string) {
        a = avroenc_new(VALUE_PAYLOAD, NULL, err, sizeof err);
        cr_assert(a, "%s", err);
        cr_assert_str_eq(avroenc_canonical_form(a), "\"string\"");
        cr_assert_eq(avroenc_fingerprint(a), avroenc_crc64("\"string\"", 8));
        struct outbox_event ev = sample();
        cr_assert_eq(avroenc_encode(a, &ev, 9, &b, err, sizeof err), 0, "%s", err);
        cr_assert_eq(b.len, 5 + 1 + 15);
        cr_assert_eq(b.data[5], 30); /* zigzag(15) */
        cr_assert_eq(memcmp(b.data + 6, ev.payload, 15), 0);
}

Test(avro, envelope_fields_are_appended_as_optional_strings) {
        struct encode_fields f;
        cr_assert_eq(encode_fields_parse("event_key:ek, headers_json.region", &f, err, sizeof err),
                     0, "%s", err);
        a = avroenc_new(VALUE_ENVELOPE, &f, err, sizeof err);
        cr_assert(a, "%s", err);
        const char *c = avroenc_canonical_form(a);
        cr_assert(strstr(c, "{\"name\":\"payload\",\"type\":\"string\"},"
                            "{\"name\":\"ek\",\"type\":[\"null\",\"string\"]},"
                            "{\"name\":\"region\",\"type\":[\"null\",\"string\"]}]}"),
                  "%s", c);
        struct outbox_event ev = sample();
        cr_assert_eq(avroenc_encode(a, &ev, -1, &b, err, sizeof err), 0, "%s", err);
        /* ... payload, ek = null (branch 0), region = branch 1 "eu" */
        const char tail[] = {0x00, 0x02, 0x04, 'e', 'u'};
        cr_assert_eq(memcmp(b.data + b.len - sizeof tail, tail, sizeof tail), 0);
}
