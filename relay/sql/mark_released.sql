-- mark_released: rows locked but never produced go back as they were, the
-- attempt not counted: FAILED if an attempt had been made before, else
-- PENDING (docs/DESIGN.md, "Status machine" step 4, "given back unattempted").
--   $1 text     relay id
--   $2 tid[]    the rows' ctids, $3 uuid[] their outbox_ids
-- Returns the outbox_id of each row given back.
UPDATE :table o
SET status = CASE WHEN o.attempt_count > 1 THEN 'FAILED' ELSE 'PENDING' END,
    attempt_count = CASE WHEN o.attempt_count > -2147483648
                         THEN o.attempt_count - 1 ELSE o.attempt_count END,
    locked_by = NULL, locked_at = NULL, updated_at = clock_timestamp()
FROM unnest($2::tid[], $3::uuid[]) AS m(tid, id)
WHERE o.ctid = m.tid AND o.outbox_id = m.id
  AND o.status = 'PUBLISHING' AND o.locked_by = $1 /* test: mark pause */
RETURNING o.outbox_id
