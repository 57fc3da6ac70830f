-- mark_unpublished: rows Kafka refused, or that could not become a message,
-- go FAILED (due again after their backoff) or DEAD (parked at 'infinity',
-- out of every lock scan's range), with the error's code and text
-- (docs/DESIGN.md, "Status machine" step 4).
--   $1 text     relay id
--   $2 text     FAILED or DEAD
--   $3 tid[]    the rows' ctids, $4 uuid[] their outbox_ids
--   $5 bigint[] backoff in ms (FAILED)
--   $6 text[]   last_error_code, $7 text[] last_error_message
--   $8 int[]    1 where the attempt does not count (attempt_count goes back)
-- Returns the outbox_id of each row marked.
--
-- Plan: unnest, then a TID scan per row.
UPDATE :table o
SET status = $2,
    available_at = CASE WHEN $2 = 'FAILED'
                        THEN now() + m.delay_ms * interval '1 millisecond'
                        ELSE 'infinity' END,
    last_error_code = m.code, last_error_message = m.msg,
    attempt_count = CASE WHEN m.uncount = 1 AND o.attempt_count > -2147483648
                         THEN o.attempt_count - 1 ELSE o.attempt_count END,
    locked_by = NULL, locked_at = NULL, updated_at = clock_timestamp()
FROM unnest($3::tid[], $4::uuid[], $5::bigint[], $6::text[], $7::text[], $8::int[])
     AS m(tid, id, delay_ms, code, msg, uncount)
WHERE o.ctid = m.tid AND o.outbox_id = m.id
  AND o.status = 'PUBLISHING' AND o.locked_by = $1 /* test: mark pause */
RETURNING o.outbox_id
