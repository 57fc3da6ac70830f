-- indexes: the table's indexes this relay's statements are written for
-- (schemas/postgres, by the names its files give them), asked once a process.
-- Returns one row per finding: an index's name, the file that defines it,
-- and what was found:
--   missing   not on the table: the statements written for it read far more
--             of the table than they need
--   invalid   left by a CREATE INDEX CONCURRENTLY that failed: the planner
--             does not use it, so the same
--   building  a CREATE INDEX CONCURRENTLY of it is running (seen only when
--             this role may read the build's progress: the same role, or
--             one with pg_read_all_stats; else it is invalid)
--   unused    outbox_event_agg_idx, which 007_guard_split.sql keeps for older
--             relays: nothing of this version reads it, each insert and mark
--             still writes it
WITH want(name, file) AS (
  VALUES ('outbox_event_due_idx', '001_outbox_event.sql'),
         ('outbox_event_agg_unpublished_idx', '007_guard_split.sql'),
         ('outbox_event_agg_published_idx', '007_guard_split.sql')),
have AS (
  SELECT c.relname::text AS name, i.indisvalid AS valid,
         EXISTS (SELECT 1 FROM pg_stat_progress_create_index p
                 WHERE p.index_relid = i.indexrelid) AS building
  FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
  WHERE i.indrelid = to_regclass(:'table'))
SELECT w.name, w.file,
       CASE WHEN h.name IS NULL THEN 'missing' WHEN h.building THEN 'building'
            ELSE 'invalid' END
FROM want w LEFT JOIN have h ON h.name = w.name
WHERE h.valid IS NOT TRUE
UNION ALL
SELECT h.name, '007_guard_split.sql', 'unused'
FROM have h
WHERE h.name = 'outbox_event_agg_idx'
