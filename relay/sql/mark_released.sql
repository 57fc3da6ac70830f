-- mark_released: rows locked but never produced go back as they were, the
-- attempt not counted: FAILED if an attempt had been made before, else
-- PENDING (docs/DESIGN.md, "Status machine" step 4, "given back unattempted").
--   $1 text     relay id
--   $2 uuid[]   the rows' outbox_ids
-- Returns the outbox_id of each row given back.
--
-- Plan: unnest, then a primary key probe per row: rows are found by
-- outbox_id, wherever an UPDATE or a table rewrite (VACUUM FULL, CLUSTER)
-- moved them since their lock (this outcome is rare: no ctid fast path).
UPDATE :table o
SET status = CASE WHEN o.attempt_count > 1 THEN 'FAILED' ELSE 'PENDING' END,
    attempt_count = CASE WHEN o.attempt_count > -2147483648
                         THEN o.attempt_count - 1 ELSE o.attempt_count END,
    locked_by = NULL, locked_at = NULL, updated_at = clock_timestamp()
FROM unnest($2::uuid[]) AS m(id)
WHERE o.outbox_id = m.id
  AND o.status = 'PUBLISHING' AND o.locked_by = $1 /* test: mark pause */
RETURNING o.outbox_id
