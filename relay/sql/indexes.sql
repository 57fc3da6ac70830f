-- indexes: the table's indexes this relay's statements are written for
-- (schemas/postgres, by the names its files give them), asked once a process.
-- Returns one row per finding: an index's name and
--   missing  not on the table: each lock statement reads far more than its batch
--   invalid  left by a CREATE INDEX CONCURRENTLY that failed: the planner
--            does not use it, so the same
--   unused   outbox_event_agg_idx, which 007_guard_split.sql keeps for older
--            relays: nothing of this version reads it, each insert and mark
--            still writes it
WITH want(name) AS (
  VALUES ('outbox_event_due_idx'), ('outbox_event_agg_unpublished_idx'),
         ('outbox_event_agg_published_idx')),
have AS (
  SELECT c.relname::text AS name, i.indisvalid AS valid
  FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
  WHERE i.indrelid = to_regclass(:'table'))
SELECT w.name, CASE WHEN h.name IS NULL THEN 'missing' ELSE 'invalid' END
FROM want w LEFT JOIN have h ON h.name = w.name
WHERE h.valid IS NOT TRUE
UNION ALL
SELECT h.name, 'unused'
FROM have h
WHERE h.name = 'outbox_event_agg_idx'
