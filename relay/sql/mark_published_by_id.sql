-- mark_published_by_id: mark_published for rows an update moved since their
-- lock, found by primary key.
--   $1 text     relay id
--   $2 uuid[]   outbox_ids
-- Returns the outbox_id of each row marked.
UPDATE :table o
SET status = 'PUBLISHED', published_at = now(), locked_by = NULL, locked_at = NULL,
    updated_at = clock_timestamp()
WHERE o.outbox_id = ANY ($2::uuid[])
  AND o.status = 'PUBLISHING' AND o.locked_by = $1 /* test: mark pause */
RETURNING o.outbox_id
