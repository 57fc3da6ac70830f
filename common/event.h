/* event.h - one outbox row as the relay sees it after locking it. */
#ifndef OUTBOX_EVENT_H
#define OUTBOX_EVENT_H

#include <stddef.h>

/* All strings are NUL-terminated and borrowed from whoever filled the struct
 * (db: the lock query's result, valid until db_batch_destroy()). Optional
 * columns are NULL when SQL NULL. */
struct outbox_event {
        const char *outbox_id;
        const char *tenant_id;
        const char *aggregate_type;
        const char *aggregate_id;
        long long aggregate_version;
        const char *event_type;
        int event_version;
        const char *topic_name;    /* NULL: from the topic template */
        const char *partition_key; /* NULL: aggregate_id */
        const char *event_key;
        const char *payload; /* JSON text; NULL publishes a tombstone */
        size_t payload_len;
        /* headers_json members as a netstring list "<len>:<name><len>:<value>..."
         * (values: strings as they are, other JSON as JSON text); NULL when
         * headers_json is not a JSON object. */
        const char *headers;
        const char *correlation_id;
        const char *causation_id;
        const char *trace_id;
        const char *occurred_at;  /* RFC 3339, UTC */
        double occurred_at_epoch; /* seconds since the epoch */
        int attempt_count;        /* after this lock */
        const char *tid;          /* the row's ctid after the lock, for the mark */
        /* A version committed after a later one of its aggregate was
         * published (late_after, that version): it cannot go out in order. */
        int late;
        long long late_after;
};

#endif
