/* test_message.c - how message_build() classifies a row it cannot make a
 * message of: a row no retry can help goes DEAD (permanent), with the code
 * and the column docs/DESIGN.md ("Kafka message") give. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "message.h"
#include "sample_event.h"

static struct config cfg;
static struct message *m;

static void start(const char *template) {
        char err[256];
        char *argv[] = {"outbox-relay", NULL};
        clearenv();
        setenv("OUTBOX_DATABASE_URL", "postgresql://u:secret@h/db", 1);
        setenv("OUTBOX_KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092", 1);
        setenv("OUTBOX_TOPIC_TEMPLATE", template, 1);
        cr_assert_eq(config_load(&cfg, CONFIG_RELAY, 1, argv, stdout, err, sizeof err), 0, "%s",
                     err);
        m = message_new(&cfg, err, sizeof err);
        cr_assert_not_null(m, "%s", err);
}

static void fini(void) {
        message_destroy(m);
        config_destroy(&cfg);
}

TestSuite(message, .fini = fini);

Test(message, an_empty_topic_is_an_invalid_value) {
        /* the columns admit '': a template that places only them makes no
         * topic, which no retry changes */
        start("{tenant_id}");
        struct outbox_event ev = sample_event();
        ev.tenant_id = "";
        struct message_parts p;
        struct message_error why;
        cr_assert_eq(message_build(m, &ev, &p, &why), -1);
        cr_assert_str_eq(why.code, "INVALID_VALUE");
        cr_assert(why.permanent && !why.uncounted);
        cr_assert(!strncmp(why.text, "tenant_id: topic '' (0 bytes)", 29), "%s", why.text);
}

Test(message, headers_not_an_object_are_invalid_headers) {
        start("outbox.event.{aggregate_type}");
        struct outbox_event ev = sample_event();
        ev.headers = NULL; /* the fetch says headers_json is not an object */
        struct message_parts p;
        struct message_error why;
        cr_assert_eq(message_build(m, &ev, &p, &why), -1);
        cr_assert_str_eq(why.code, "INVALID_HEADERS");
        cr_assert(why.permanent && !why.uncounted);
}

Test(message, a_legal_row_builds) {
        start("outbox.event.{aggregate_type}");
        struct outbox_event ev = sample_event();
        struct message_parts p;
        struct message_error why;
        cr_assert_eq(message_build(m, &ev, &p, &why), 0, "%s: %s", why.code, why.text);
        cr_assert_str_eq(p.topic, "outbox.event.Order");
}
