/* Unit tests of config: precedence, validation messages, Kafka mapping. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config.h"
#include "config_fixture.h"

TestSuite(config, .init = init, .fini = fini);

static int load(int argc, char **argv) {
        return config_load(&cfg, CONFIG_RELAY, argc, argv, stdout, err, sizeof err);
}

Test(config, defaults) {
        char *argv[] = {"outbox-relay"};
        cr_assert_eq(load(1, argv), 0, "%s", err);
        cr_assert_str_eq(cfg.table, "outbox_event");
        cr_assert_eq(cfg.batch_size, 500);
        cr_assert_eq(cfg.poll_interval_ms, 200);
        cr_assert_eq(cfg.ordering, ORDERING_AGGREGATE);
        cr_assert_eq(cfg.max_attempts, 10);
        cr_assert_eq(cfg.backoff_initial_ms, 1000);
        cr_assert_eq(cfg.backoff_max_ms, 300000);
        cr_assert_str_eq(cfg.topic_template, "outbox.event.{aggregate_type}");
        cr_assert_str_eq(cfg.http_addr, "0.0.0.0:9464");
        cr_assert_eq(cfg.log_format_json, 1);
        cr_assert_eq(cfg.schema_registry_auto_register, 1);
        cr_assert(strchr(cfg.relay_id, '-'), "relay id is hostname-pid: %s", cfg.relay_id);
        cr_assert_eq(cfg.kafka_cnt, 1);
        cr_assert_str_eq(cfg.kafka[0].name, "bootstrap.servers");
}

Test(config, precedence_flag_env_file_default) {
        char path[] = "/tmp/outbox-config-XXXXXX";
        int fd = mkstemp(path);
        cr_assert(fd >= 0);
        FILE *f = fdopen(fd, "w");
        fprintf(f, "# comment\nbatch_size = 7\npoll_interval_ms = \"9\"\nmax_attempts=3\n"
                   "kafka_linger_ms = 1\n");
        fclose(f);
        setenv("OUTBOX_POLL_INTERVAL_MS", "11", 1);
        setenv("OUTBOX_MAX_ATTEMPTS", "12", 1);
        char *argv[] = {"outbox-relay", "--config", path, "--max-attempts", "13", "-X", "acks=1"};
        cr_assert_eq(load(7, argv), 0, "%s", err);
        unlink(path);
        cr_assert_eq(cfg.batch_size, 7);        /* file */
        cr_assert_eq(cfg.poll_interval_ms, 11); /* env beats file */
        cr_assert_eq(cfg.max_attempts, 13);     /* flag beats env */
        int seen = 0;
        for (size_t i = 0; i < cfg.kafka_cnt; i++) {
                if (!strcmp(cfg.kafka[i].name, "linger.ms"))
                        seen += !strcmp(cfg.kafka[i].value, "1");
                if (!strcmp(cfg.kafka[i].name, "acks"))
                        seen += !strcmp(cfg.kafka[i].value, "1");
        }
        cr_assert_eq(seen, 2);
}

Test(config, errors_name_the_variable) {
        struct {
                const char *var, *val, *want;
        } cases[] = {
                {"OUTBOX_BATCH_SIZE", "abc", "OUTBOX_BATCH_SIZE: not an integer"},
                {"OUTBOX_BATCH_SIZE", "0", "OUTBOX_BATCH_SIZE: 0 is out of range"},
                {"OUTBOX_ORDERING", "random", "OUTBOX_ORDERING: unknown value 'random'"},
                {"OUTBOX_TABLE", "x; drop table y", "OUTBOX_TABLE:"},
                {"OUTBOX_TABLE", "a.b.c", "OUTBOX_TABLE:"},
                {"OUTBOX_TOPIC_TEMPLATE", "t.{nope}", "OUTBOX_TOPIC_TEMPLATE: unknown placeholder"},
                {"OUTBOX_HTTP_ADDR", "nowhere", "OUTBOX_HTTP_ADDR:"},
                {"OUTBOX_VALUE_FORMAT", "xml", "OUTBOX_VALUE_FORMAT:"},
                {"OUTBOX_DATABASE_URL", "", "OUTBOX_DATABASE_URL: required"},
                {"OUTBOX_KAFKA_BOOTSTRAP_SERVERS", "", "OUTBOX_KAFKA_BOOTSTRAP_SERVERS: required"},
        };
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
                init();
                setenv(cases[i].var, cases[i].val, 1);
                char *argv[] = {"outbox-relay"};
                cr_assert_eq(load(1, argv), -1, "%s=%s accepted", cases[i].var, cases[i].val);
                cr_assert(strstr(err, cases[i].want), "got '%s', want '%s'", err, cases[i].want);
                config_destroy(&cfg);
        }
}

Test(config, unknown_flag_and_file_key) {
        char *argv[] = {"outbox-relay", "--batchsize", "3"};
        cr_assert_eq(load(3, argv), -1);
        cr_assert(strstr(err, "--batchsize: unknown option"), "%s", err);
}

Test(config, help_and_version) {
        char *a1[] = {"outbox-relay", "--help"};
        cr_assert_eq(load(2, a1), CONFIG_EXIT_HELP);
        config_destroy(&cfg);
        char *a2[] = {"outbox-relay", "--version"};
        cr_assert_eq(load(2, a2), CONFIG_EXIT_VERSION);
}

Test(config, kafka_property_mapping) {
        struct {
                const char *in, *out;
        } m[] = {
                {"BOOTSTRAP_SERVERS", "bootstrap.servers"},
                {"SASL_MECHANISM", "sasl.mechanism"},
                {"SSL_CA_LOCATION", "ssl.ca.location"},
                {"MAX_IN_FLIGHT_REQUESTS_PER_CONNECTION", "max.in.flight.requests.per.connection"},
                {"SOME__UNDER", "some_under"},
                {"A___B", "a-b"},
        };
        for (size_t i = 0; i < sizeof m / sizeof m[0]; i++) {
                char *p = config_kafka_property(m[i].in);
                cr_assert_str_eq(p, m[i].out);
                free(p);
        }
}

Test(config, identifiers) {
        cr_assert_eq(config_check_identifier("outbox_event"), 0);
        cr_assert_eq(config_check_identifier("svc.outbox_event"), 0);
        cr_assert_neq(config_check_identifier("1abc"), 0);
        cr_assert_neq(config_check_identifier("a."), 0);
        cr_assert_neq(config_check_identifier(".a"), 0);
        cr_assert_neq(config_check_identifier("a-b"), 0);
        cr_assert_neq(config_check_identifier(""), 0);
        /* non-ASCII letters, as PostgreSQL's unquoted identifiers take them */
        cr_assert_eq(config_check_identifier("\xc3\xa9v\xc3\xa9nements.outbox_event"), 0);
        cr_assert_neq(config_check_identifier("bad\xff.outbox_event"), 0);
        cr_assert_neq(config_check_identifier("tab\tle"), 0);
}

/* Settings that are well-formed but cannot work: exit 2, naming the variable. */
Test(config, settings_that_cannot_work) {
        char long_id[300], long_template[300], literal_only[260];
        memset(long_id, 'r', sizeof long_id - 1);
        long_id[sizeof long_id - 1] = '\0';
        snprintf(long_template, sizeof long_template, "%.247s.{aggregate_type}.{event_type}",
                 long_id);
        memset(literal_only, 't', sizeof literal_only - 1);
        literal_only[sizeof literal_only - 1] = '\0';
        struct {
                const char *var, *val, *want;
        } cases[] = {
                {"OUTBOX_TOPIC_TEMPLATE", "outbox event.{aggregate_type}",
                 "OUTBOX_TOPIC_TEMPLATE: ' ' (byte 0x20) at offset 6"},
                {"OUTBOX_TOPIC_TEMPLATE", "outbox/{aggregate_type}", "OUTBOX_TOPIC_TEMPLATE:"},
                {"OUTBOX_TOPIC_TEMPLATE", "caf\xc3\xa9.{aggregate_type}", "byte 0xc3"},
                {"OUTBOX_TOPIC_TEMPLATE", "x}{aggregate_type}", "OUTBOX_TOPIC_TEMPLATE:"},
                {"OUTBOX_TOPIC_TEMPLATE", long_template, "without the placeholders' values"},
                {"OUTBOX_TOPIC_TEMPLATE", literal_only, "OUTBOX_TOPIC_TEMPLATE:"},
                {"OUTBOX_TOPIC_TEMPLATE", "..", "not a legal Kafka topic name"},
                {"OUTBOX_RELAY_ID", "relay\n1", "OUTBOX_RELAY_ID: not printable"},
                {"OUTBOX_RELAY_ID", "relay\x1b[31m", "OUTBOX_RELAY_ID: not printable"},
                {"OUTBOX_RELAY_ID", long_id, "OUTBOX_RELAY_ID: 299 bytes, at most 200"},
                {"OUTBOX_PRODUCER_NAME", "svc\r\n", "OUTBOX_PRODUCER_NAME: not printable"},
        };
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
                init();
                setenv(cases[i].var, cases[i].val, 1);
                char *argv[] = {"outbox-relay"};
                cr_assert_eq(load(1, argv), -1, "case %zu accepted", i);
                cr_assert(strstr(err, cases[i].want), "case %zu: got '%s', want '%s'", i, err,
                          cases[i].want);
                cr_assert(!strchr(err, '\n'), "case %zu: one line: %s", i, err);
                config_destroy(&cfg);
        }
        /* the sweeper's retention: at most 100 years */
        init();
        setenv("OUTBOX_RETENTION_S", "9223372036854775807", 1);
        char *argv[] = {"outbox-sweeper"};
        cr_assert_eq(config_load(&cfg, CONFIG_SWEEPER, 1, argv, stdout, err, sizeof err), -1);
        cr_assert(strstr(err, "OUTBOX_RETENTION_S:"), "%s", err);
}

/* What works stays accepted: the edges of the rules above. */
Test(config, settings_at_the_edges_are_accepted) {
        char id[201], template[300];
        memset(id, 'r', 200);
        id[200] = '\0';
        /* 247 literal characters and two placeholders: 249 with one-character values */
        memset(template, 'a', 247);
        snprintf(template + 247, sizeof template - 247, "{aggregate_type}{event_type}");
        const char *const env[][2] = {
                {"OUTBOX_TOPIC_TEMPLATE", "A-z_0.9-{tenant_id}.{aggregate_type}.{event_type}"},
                {"OUTBOX_TOPIC_TEMPLATE", "fixed.topic"},
                {"OUTBOX_TOPIC_TEMPLATE", template},
                {"OUTBOX_RELAY_ID", id},
                {"OUTBOX_RELAY_ID", "relay \xc3\xa9-7"},
                {"OUTBOX_PRODUCER_NAME", "orders-service"},
        };
        for (size_t i = 0; i < sizeof env / sizeof env[0]; i++) {
                init();
                setenv(env[i][0], env[i][1], 1);
                char *argv[] = {"outbox-relay"};
                cr_assert_eq(load(1, argv), 0, "case %zu: %s", i, err);
                config_destroy(&cfg);
        }
}

/* What libpq refuses is bad configuration, named, without the password. */
Test(config, database_url_checked_by_libpq) {
        const char *bad[] = {
                "postgresql://outbox:SECRET@[::1:5432/outbox",
                "postgresql://outbox:SECRET@db/outbox?sslmode=bogus",
                "postgresql://outbox:SECRET@db/outbox?foo=bar",
                "host=db password=SECRET port=notaport",
                "host=db password='SECRET",
        };
        char *argv[] = {"outbox-relay"};
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
                config_destroy(&cfg);
                setenv("OUTBOX_DATABASE_URL", bad[i], 1);
                cr_expect_eq(load(1, argv), -1, "%s accepted", bad[i]);
                cr_expect_eq(strncmp(err, "OUTBOX_DATABASE_URL: ", 21), 0, "%s", err);
                cr_expect_null(strstr(err, "SECRET"), "%s", err);
                cr_expect_null(strchr(err, '\n'), "%s", err);
        }
        config_destroy(&cfg);
        setenv("OUTBOX_DATABASE_URL", "host=db\n\tpassword='SE CR\\'ET'\nport=5433", 1);
        cr_expect_eq(load(1, argv), 0, "%s", err);
}

/* A line longer than the reader's buffer is an error, not cut into two. */
Test(config, file_line_too_long) {
        char path[] = "/tmp/outbox-config-XXXXXX";
        int fd = mkstemp(path);
        cr_assert(fd >= 0);
        FILE *f = fdopen(fd, "w");
        fprintf(f, "topic_template = ");
        for (int i = 0; i < 5000; i++)
                fputc('x', f);
        fprintf(f, "batch_size = 7\n");
        fclose(f);
        char *argv[] = {"outbox-relay", "--config", path};
        cr_expect_eq(load(3, argv), -1);
        unlink(path);
        cr_expect_not_null(strstr(err, "line 1: longer than"), "%s", err);
}

Test(config, avro_registry_and_envelope_fields) {
        setenv("OUTBOX_SERIALIZATION", "avro", 1);
        setenv("OUTBOX_SCHEMA_REGISTRY_URL", "http://registry:8081", 1);
        setenv("OUTBOX_ENVELOPE_FIELDS", "event_key:ek,headers_json.x-region:region", 1);
        char *argv[] = {"outbox-relay"};
        cr_assert_eq(load(1, argv), 0, "%s", err);
        cr_assert_eq(cfg.serialization, SERIALIZATION_AVRO);
        cr_assert_str_eq(cfg.schema_registry_url, "http://registry:8081");
        cr_assert_str_eq(cfg.envelope_fields, "event_key:ek,headers_json.x-region:region");
}

Test(config, avro_and_envelope_field_errors_name_the_variable) {
        struct {
                const char *var, *val, *want;
        } cases[] = {
                {"OUTBOX_SERIALIZATION", "protobuf", "OUTBOX_SERIALIZATION: unknown value"},
                {"OUTBOX_SCHEMA_REGISTRY_AUTO_REGISTER", "maybe",
                 "OUTBOX_SCHEMA_REGISTRY_AUTO_REGISTER: unknown value 'maybe' (expected one of: "
                 "false, true)"},
                {"OUTBOX_SCHEMA_REGISTRY_URL", "registry:8081",
                 "OUTBOX_SCHEMA_REGISTRY_URL: must start with http://"},
                {"OUTBOX_ENVELOPE_FIELDS", "nope", "OUTBOX_ENVELOPE_FIELDS: unknown source 'nope'"},
                {"OUTBOX_ENVELOPE_FIELDS", "headers_json.x-region",
                 "OUTBOX_ENVELOPE_FIELDS: 'x-region' is not a valid field name"},
                {"OUTBOX_ENVELOPE_FIELDS", "event_key:payload",
                 "OUTBOX_ENVELOPE_FIELDS: field name 'payload' is already an envelope key"},
                {"OUTBOX_ENVELOPE_FIELDS", "event_key,headers_json.event_key",
                 "OUTBOX_ENVELOPE_FIELDS: field name 'event_key' given twice"},
        };
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
                init();
                setenv("OUTBOX_SERIALIZATION", "avro", 1);
                setenv(cases[i].var, cases[i].val, 1);
                char *argv[] = {"outbox-relay"};
                cr_assert_eq(load(1, argv), -1, "%s=%s accepted", cases[i].var, cases[i].val);
                cr_assert(strstr(err, cases[i].want), "got '%s', want '%s'", err, cases[i].want);
                config_destroy(&cfg);
        }
        /* the registry is for avro only; envelope fields need an envelope */
        init();
        setenv("OUTBOX_SCHEMA_REGISTRY_URL", "http://r:8081", 1);
        char *argv[] = {"outbox-relay"};
        cr_assert_eq(load(1, argv), -1);
        cr_assert(strstr(err, "OUTBOX_SCHEMA_REGISTRY_URL: set, but OUTBOX_SERIALIZATION is json"),
                  "%s", err);
        config_destroy(&cfg);
        init();
        setenv("OUTBOX_VALUE_FORMAT", "payload", 1);
        setenv("OUTBOX_ENVELOPE_FIELDS", "event_key", 1);
        cr_assert_eq(load(1, argv), -1);
        cr_assert(strstr(err, "OUTBOX_ENVELOPE_FIELDS: set, but OUTBOX_VALUE_FORMAT is payload"),
                  "%s", err);
}

Test(config, outboxctl_reads_its_own_settings) {
        char *argv[] = {"outboxctl"};
        setenv("OUTBOX_BATCH_SIZE", "not-a-number", 1); /* the relay's: not read */
        unsetenv("OUTBOX_KAFKA_BOOTSTRAP_SERVERS");     /* only reconcile needs it */
        setenv("OUTBOX_KAFKA_SECURITY_PROTOCOL", "SSL", 1);
        setenv("OUTBOX_TOPIC_TEMPLATE", "orders.{tenant_id}", 1);
        cr_assert_eq(config_load(&cfg, CONFIG_CTL, 1, argv, stdout, err, sizeof err), 0, "%s", err);
        cr_assert_eq(cfg.log_format_json, 0, "outboxctl logs text by default");
        cr_assert_eq(config_log_json_hint(CONFIG_CTL, 1, argv), 0);
        cr_assert_eq(config_log_json_hint(CONFIG_RELAY, 1, argv), 1);
        cr_assert_str_eq(cfg.topic_template, "orders.{tenant_id}");
        cr_assert_eq(cfg.kafka_cnt, 1);
        cr_assert_str_eq(cfg.kafka[0].name, "security.protocol");
        config_destroy(&cfg);

        setenv("OUTBOX_LOG_FORMAT", "json", 1);
        cr_assert_eq(config_load(&cfg, CONFIG_CTL, 1, argv, stdout, err, sizeof err), 0, "%s", err);
        cr_assert_eq(cfg.log_format_json, 1);
        cr_assert_eq(config_log_json_hint(CONFIG_CTL, 1, argv), 1);
        config_destroy(&cfg);

        setenv("OUTBOX_TOPIC_TEMPLATE", "orders.{nope}", 1);
        cr_assert_eq(config_load(&cfg, CONFIG_CTL, 1, argv, stdout, err, sizeof err), -1);
        cr_assert(strstr(err, "OUTBOX_TOPIC_TEMPLATE"), "%s", err);
}
