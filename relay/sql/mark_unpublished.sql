-- mark_unpublished: rows Kafka refused, or that could not become a message,
-- go FAILED (due again after their backoff) or DEAD (parked at 'infinity',
-- out of every lock scan's range), with the error's code and text
-- (docs/DESIGN.md, "Status machine" step 4).
--   $1 text     relay id
--   $2 text     FAILED or DEAD
--   $3 uuid[]   the rows' outbox_ids
--   $4 bigint[] backoff in ms (FAILED)
--   $5 text[]   last_error_code, $6 text[] last_error_message
--   $7 int[]    1 where the attempt does not count (attempt_count goes back)
-- Returns the outbox_id of each row marked.
--
-- Plan: unnest, then a primary key probe per row: rows are found by
-- outbox_id, wherever an UPDATE or a table rewrite (VACUUM FULL, CLUSTER)
-- moved them since their lock (these outcomes are rare: no ctid fast path).
UPDATE :table o
SET status = $2,
    available_at = CASE WHEN $2 = 'FAILED'
                        THEN now() + m.delay_ms * interval '1 millisecond'
                        ELSE 'infinity' END,
    last_error_code = m.code, last_error_message = m.msg,
    attempt_count = CASE WHEN m.uncount = 1 AND o.attempt_count > -2147483648
                         THEN o.attempt_count - 1 ELSE o.attempt_count END,
    locked_by = NULL, locked_at = NULL, updated_at = clock_timestamp()
FROM unnest($3::uuid[], $4::bigint[], $5::text[], $6::text[], $7::int[])
     AS m(id, delay_ms, code, msg, uncount)
WHERE o.outbox_id = m.id
  AND o.status = 'PUBLISHING' AND o.locked_by = $1 /* test: mark pause */
RETURNING o.outbox_id
