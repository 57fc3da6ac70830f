/* config_fixture.h - the configuration fixture unit tests share: a clean
 * environment with the two required variables set, and a struct config that
 * is destroyed after each test. Include once per test file; criterion runs
 * each test in its own process, so the environment is the test's own. */
#ifndef OUTBOX_TEST_CONFIG_FIXTURE_H
#define OUTBOX_TEST_CONFIG_FIXTURE_H

#include <stdlib.h>

#include "config.h"

static struct config cfg;
static char err[512];

static void init(void) {
        clearenv();
        setenv("OUTBOX_DATABASE_URL", "postgresql://u:secret@h/db", 1);
        setenv("OUTBOX_KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092", 1);
}

static void fini(void) {
        config_destroy(&cfg);
}

#endif
