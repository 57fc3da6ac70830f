-- lock_none: locks the next batch under OUTBOX_ORDERING=none: the oldest due
-- rows, in no order per aggregate (docs/DESIGN.md, "Status machine" step 1).
--   $1 text      relay id (locked_by)
--   $2 int       rows at most
-- Returns the locked rows as lock does (late_after NULL, key 0, never deferred
-- or parked).
--
-- Plan: one index scan of outbox_event_due_idx, then the update by ctid.
WITH window_rows AS MATERIALIZED (
  SELECT o.ctid AS tid
  FROM :table o
  WHERE o.published_at IS NULL AND o.status IN ('PENDING', 'FAILED')
    AND o.available_at <= now() /* test: lock pause */
  ORDER BY o.available_at, o.aggregate_version
  LIMIT $2
  FOR UPDATE OF o SKIP LOCKED)
UPDATE :table o
SET status = 'PUBLISHING', locked_by = $1, locked_at = now(), last_attempt_at = now(),
    attempt_count = CASE WHEN o.attempt_count < 2147483647 THEN o.attempt_count + 1
                         ELSE o.attempt_count END,
    -- a requeued late row loses its code when sent: lock.sql's guard takes a
    -- PUBLISHING row with the code for one on its way to DEAD
    last_error_code = NULLIF(o.last_error_code, 'LATE_VERSION'),
    last_error_message = CASE WHEN o.last_error_code = 'LATE_VERSION' THEN NULL
                              ELSE o.last_error_message END,
    updated_at = clock_timestamp()
FROM window_rows c
WHERE o.ctid = c.tid
RETURNING o.ctid, o.outbox_id, o.attempt_count, NULL::bigint AS late_after,
  o.tenant_id, o.aggregate_type, o.aggregate_id, o.aggregate_version,
  coalesce(pg_column_size(o.payload_json), 0)::bigint + pg_column_size(o.headers_json)
  + octet_length(o.tenant_id)::bigint + octet_length(o.aggregate_type)
  + octet_length(o.aggregate_id) + octet_length(o.event_type)
  + coalesce(octet_length(o.topic_name), 0)::bigint + coalesce(octet_length(o.partition_key), 0)
  + coalesce(octet_length(o.event_key), 0)::bigint + coalesce(octet_length(o.correlation_id), 0)
  + coalesce(octet_length(o.causation_id), 0)::bigint + coalesce(octet_length(o.trace_id), 0)
  AS size, 0::bigint AS k, false AS deferred, false AS parked
