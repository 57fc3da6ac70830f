/* sample_event.h - the outbox row the encode and avro unit tests start from.
 * Include once per test file. */
#ifndef OUTBOX_TEST_SAMPLE_EVENT_H
#define OUTBOX_TEST_SAMPLE_EVENT_H

#include "event.h"

static struct outbox_event sample_event(void) {
        struct outbox_event ev = {
                .outbox_id = "0b8f3f2e-8a57-4c39-9a0e-3c1d2a0f6b11",
                .tenant_id = "acme",
                .aggregate_type = "Order",
                .aggregate_id = "o-1",
                .aggregate_version = 7,
                .event_type = "OrderCreated",
                .event_version = 2,
                .payload = "{\"total\": 12.5}",
                .payload_len = 15,
                .headers = "",
                .occurred_at = "2026-11-23T00:00:00.000001Z",
                .attempt_count = 1,
        };
        return ev;
}

#endif
