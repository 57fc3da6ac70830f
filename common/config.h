/* config.h - configuration from flags, environment, a key = value file and
 * defaults, in that order of precedence (docs/DESIGN.md, "Configuration"). The only
 * module that reads the environment. */
#ifndef OUTBOX_CONFIG_H
#define OUTBOX_CONFIG_H

#include <stddef.h>
#include <stdio.h>

/* The programs that read the configuration; each setting names those it
 * applies to (a bit mask of these). CONFIG_CTL is outboxctl, which reads the
 * environment only. */
enum config_program { CONFIG_RELAY = 1, CONFIG_SWEEPER = 2, CONFIG_CTL = 4 };
/* OUTBOX_ORDERING: consecutive versions per aggregate (gaps held), versions
 * that only increase, or no order at all (docs/DESIGN.md, "Per-aggregate
 * order"). */
enum config_ordering { ORDERING_AGGREGATE = 0, ORDERING_NONE, ORDERING_INCREASING };
enum config_value_format { VALUE_ENVELOPE = 0, VALUE_PAYLOAD };
enum config_serialization { SERIALIZATION_JSON = 0, SERIALIZATION_AVRO };

/* One librdkafka property and where it came from (for error messages). */
struct config_kafka_prop {
        char *name; /* librdkafka property, e.g. bootstrap.servers */
        char *value;
        char *source; /* e.g. OUTBOX_KAFKA_BOOTSTRAP_SERVERS */
};

struct config {
        char *database_url;
        char *table;
        char *relay_id;
        int batch_size;
        long long batch_bytes; /* the rows the relay holds, in bytes of their values */
        int poll_interval_ms;
        int ordering; /* enum config_ordering */
        int max_attempts;
        int backoff_initial_ms;
        int backoff_max_ms;
        char *topic_template;
        int value_format;  /* enum config_value_format */
        int serialization; /* enum config_serialization */
        char *schema_registry_url;
        int schema_registry_auto_register; /* 0: look the schema up only */
        char *envelope_fields;             /* OUTBOX_ENVELOPE_FIELDS, see encode_fields_parse() */
        char *producer_name;
        char *http_addr; /* "off" disables */
        int log_level;   /* enum log_level */
        int log_format_json;
        int statement_timeout_ms; /* the sessions' statement_timeout */
        int db_lock_timeout_ms;   /* the sessions' lock_timeout */
        int lock_timeout_s;
        int sweep_interval_s;
        long long retention_s;
        int retention_keep_latest; /* keep each aggregate's latest published row */
        int delete_batch;
        int once; /* sweeper --once */
        /* Fault-test pauses, read only by builds with -DOUTBOX_TEST_HOOKS=ON
         * (else 0): OUTBOX_TEST_LOCK_DELAY_MS, OUTBOX_TEST_SAMPLE_DELAY_MS,
         * OUTBOX_TEST_MARK_DELAY_MS, OUTBOX_TEST_REPLAY_PAUSE_MS; and
         * faults: OUTBOX_TEST_FETCH_FAULT_VERSION,
         * OUTBOX_TEST_FETCH_KILL_VERSION. */
        int test_lock_delay_ms;
        int test_sample_delay_ms;
        int test_mark_delay_ms;
        int test_replay_pause_ms;
        int test_fetch_fault_version;
        int test_fetch_kill_version;

        struct config_kafka_prop *kafka;
        size_t kafka_cnt;
};

/* Outcomes of config_load() besides 0 (ok) and -1 (bad configuration). */
#define CONFIG_EXIT_HELP    1 /* --help printed: exit 0 */
#define CONFIG_EXIT_VERSION 2 /* --version printed: exit 0 */

/* Fills *cfg from argv, the environment, the --config file and defaults, and
 * validates it. On -1, errstr holds one line naming the variable and the
 * problem. Help and version text go to `out`. The caller frees with
 * config_destroy() whatever the result. */
int config_load(struct config *cfg, enum config_program prog, int argc, char **argv, FILE *out,
                char *errstr, size_t errstr_size) __attribute__((warn_unused_result));

/* The log format (1 JSON, 0 text) that --log-format, OUTBOX_LOG_FORMAT or the
 * --config file ask for, read on a best-effort basis, so that a configuration
 * config_load() refuses is still reported in the format the operator chose.
 * Without any, the program's default (text for outboxctl, else JSON). */
int config_log_json_hint(enum config_program prog, int argc, char **argv);

/* Writes one line per setting `prog` reads from the environment: variable,
 * default and meaning (outboxctl's --help). */
void config_print_settings(FILE *out, enum config_program prog);

/* Frees everything config_load() allocated; safe on a zeroed struct. */
void config_destroy(struct config *cfg);

/* Validates `table` as an identifier or schema.identifier (letters, digits,
 * underscores, not starting with a digit, at most 63 bytes each). 0 if valid. */
int config_check_identifier(const char *table);

/* Maps an environment name (OUTBOX_KAFKA_SASL_MECHANISM) or file key
 * (kafka_sasl_mechanism) suffix to a librdkafka property (sasl.mechanism):
 * lower-case, "___" -> "-", "__" -> "_", "_" -> ".". Returns a malloc'd string
 * the caller frees, or NULL on allocation failure. */
char *config_kafka_property(const char *suffix);

#endif
