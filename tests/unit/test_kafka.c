/* Unit tests of kafka's producer configuration: the relay's defaults and
 * what a user's properties do to them (no broker needed). */
#include <criterion/criterion.h>
#include <librdkafka/rdkafka.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "config_fixture.h"
#include "kafka.h"

TestSuite(kafka, .init = init, .fini = fini);

static const char *get(const char *name) {
        static char v[256];
        char *argv[] = {"outbox-relay"};
        cr_assert_eq(config_load(&cfg, CONFIG_RELAY, 1, argv, stdout, err, sizeof err), 0, "%s",
                     err);
        cr_assert_eq(kafka_conf_get(&cfg, name, v, sizeof v, err, sizeof err), 0, "%s", err);
        config_destroy(&cfg);
        memset(&cfg, 0, sizeof cfg);
        return v;
}

static int have_zstd(void) {
        char features[512];
        size_t size = sizeof features;
        rd_kafka_conf_t *conf = rd_kafka_conf_new();
        int ok = rd_kafka_conf_get(conf, "builtin.features", features, &size) == RD_KAFKA_CONF_OK &&
                 strstr(features, "zstd") != NULL;
        rd_kafka_conf_destroy(conf);
        return ok;
}

Test(kafka, contract_defaults) {
        cr_assert_str_eq(get("acks"), "-1"); /* all */
        cr_assert_str_eq(get("enable.idempotence"), "true");
        cr_assert_str_eq(get("max.in.flight.requests.per.connection"), "5");
        cr_assert_str_eq(get("linger.ms"), "5");
        cr_assert_str_eq(get("delivery.timeout.ms"), "120000");
}

Test(kafka, zstd_at_level_1_by_default) {
        if (!have_zstd())
                cr_skip_test("librdkafka built without zstd");
        cr_assert_str_eq(get("compression.type"), "zstd");
        cr_assert_str_eq(get("compression.level"), "1");
}

Test(kafka, a_users_level_wins) {
        if (!have_zstd())
                cr_skip_test("librdkafka built without zstd");
        setenv("OUTBOX_KAFKA_COMPRESSION_LEVEL", "7", 1);
        cr_assert_str_eq(get("compression.level"), "7");
}

Test(kafka, another_codec_keeps_its_own_default_level) {
        setenv("OUTBOX_KAFKA_COMPRESSION_TYPE", "gzip", 1);
        cr_assert_str_eq(get("compression.type"), "gzip");
        cr_assert_str_eq(get("compression.level"), "-1");
}

Test(kafka, idempotence_cannot_be_turned_off) {
        char v[64];
        char *argv[] = {"outbox-relay"};
        setenv("OUTBOX_KAFKA_ENABLE_IDEMPOTENCE", "false", 1);
        cr_assert_eq(config_load(&cfg, CONFIG_RELAY, 1, argv, stdout, err, sizeof err), 0, "%s",
                     err);
        cr_assert_eq(kafka_conf_get(&cfg, "acks", v, sizeof v, err, sizeof err), -1);
        cr_assert(strstr(err, "idempotence cannot be turned off"), "%s", err);
}
