-- mark_published: rows Kafka acknowledged go PUBLISHED (docs/DESIGN.md,
-- "Status machine" step 4), each found by the ctid its lock returned and
-- checked against its outbox_id: only rows this relay still holds.
--   $1 text     relay id
--   $2 tid[]    the rows' ctids
--   $3 uuid[]   their outbox_ids, in the same order
-- Returns the outbox_id of each row marked; a row missing from the answer
-- moved since its lock (mark_published_by_id looks for it) or was taken back.
--
-- Plan: unnest, then a TID scan per row.
UPDATE :table o
SET status = 'PUBLISHED', published_at = now(), locked_by = NULL, locked_at = NULL,
    updated_at = clock_timestamp()
FROM unnest($2::tid[], $3::uuid[]) AS m(tid, id)
WHERE o.ctid = m.tid AND o.outbox_id = m.id
  AND o.status = 'PUBLISHING' AND o.locked_by = $1 /* test: mark pause */
RETURNING o.outbox_id
