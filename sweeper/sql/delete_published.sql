-- delete_published: the retention delete (docs/DESIGN.md, "The sweeper",
-- step 3): PUBLISHED rows published longer ago than the retention, oldest
-- first.
--   $1 bigint  OUTBOX_RETENTION_S
--   $2 int     rows at most
-- Returns the number of rows deleted, and of rows looked at.
--
-- Plan: outbox_event_retention_idx (kept rows, at available_at 'infinity',
-- are out of its range); rows another statement holds are skipped.
WITH gone AS (
  DELETE FROM :table
  WHERE outbox_id IN (
    SELECT outbox_id
    FROM :table
    WHERE published_at IS NOT NULL AND available_at <> 'infinity'
      AND published_at < now() - $1 * interval '1 second'
    ORDER BY published_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED)
  RETURNING 1)
SELECT count(*), count(*)
FROM gone
