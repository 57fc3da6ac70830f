-- indexes: the table's indexes a daemon's statements are written for
-- (schemas/postgres), asked by the relay once a process and again when a
-- lock statement starts to time out, and by the sweeper once a process and
-- again when a sweep starts to time out. Each index is known by its
-- definition (a btree, its key columns in ascending order, its predicate),
-- whatever its name, so a table made from the files under another name is
-- checked too; the names below are the files' own.
--   $1 text[]  the indexes the caller's statements read, by role: due (the
--              relay's lock statements; the sweeper's stale-lock scan and
--              parking), unpublished and published (the relay's order
--              guard; published also the sweeper's keep-latest retention),
--              retention (the sweeper's retention delete); and old (a
--              relay): report the guard index of relays before 007
-- Returns one row per finding: an index's name, the file that defines it,
-- and what was found:
--   missing    none on the table: the statements written for it read far
--              more of the table than they need
--   different  an index of the file's name that serves none of the
--              definitions: the same
--   invalid    left by a CREATE INDEX CONCURRENTLY that failed, or one still
--              running that this role cannot see: the planner does not use
--              it, so the same
--   building   a CREATE INDEX CONCURRENTLY of it is running (seen only when
--              this role may read the build's progress: the same role, or
--              one with pg_read_all_stats; else it is invalid)
-- and, asked for old:
--   unused     the guard index of relays before 007_guard_split.sql, which
--              that file keeps for them: nothing of this version reads it
--              while both guard indexes are valid; each insert and mark
--              still writes it
--   in_use     the same index, valid, while a guard index is missing or not
--              valid: the probes read it in their place
--   old_invalid  the same index, not valid: relays of earlier versions (a
--              rolling upgrade, a rollback) probe it
WITH idx AS MATERIALIZED (
  SELECT c.relname::text AS name, i.indisvalid AS valid,
         EXISTS (SELECT 1 FROM pg_stat_progress_create_index p
                 WHERE p.index_relid = i.indexrelid) AS building,
         CASE
           WHEN NOT k.plain THEN NULL
           WHEN k.k1 = 'available_at' AND k.k2 = 'aggregate_version' AND i.indnkeyatts = 2
                AND k.pred = 'published_at IS NULL' THEN 'due'
           WHEN k.hashed AND k.k2 = 'aggregate_version' AND i.indnkeyatts = 2
                AND k.pred = 'published_at IS NULL' THEN 'unpublished'
           WHEN k.hashed AND k.k2 = 'aggregate_version' AND i.indnkeyatts = 2
                AND k.pred = 'published_at IS NOT NULL' THEN 'published'
           WHEN k.k1 = 'published_at' AND i.indnkeyatts = 1
                AND k.pred = 'published_at IS NOT NULL AND available_at <> '
                             || '''infinity''::timestamp with time zone' THEN 'retention'
           WHEN k.hashed AND k.k2 = 'aggregate_version' AND i.indnkeyatts = 3
                AND pg_get_indexdef(i.indexrelid, 3, true) = '(published_at IS NULL)'
                AND k.pred IS NULL THEN 'old'
         END AS role
  FROM pg_index i
  JOIN pg_class c ON c.oid = i.indexrelid
  CROSS JOIN LATERAL (
    SELECT pg_get_indexdef(i.indexrelid, 1, true) AS k1,
           -- the key as the files write it: the seed 0, written 0 or '0'
           pg_get_indexdef(i.indexrelid, 1, true) IN (
             'hashtextextended(aggregate_id, hashtextextended(aggregate_type,'
               || ' hashtextextended(tenant_id, 0::bigint)))',
             'hashtextextended(aggregate_id, hashtextextended(aggregate_type,'
               || ' hashtextextended(tenant_id, ''0''::bigint)))') AS hashed,
           pg_get_indexdef(i.indexrelid, 2, true) AS k2,
           pg_get_expr(i.indpred, i.indrelid, true) AS pred,
           -- a btree of ascending keys (what the statements' ORDER BYs and
           -- probes are written for)
           c.relam = (SELECT a.oid FROM pg_am a WHERE a.amname = 'btree')
             AND NOT EXISTS (SELECT 1 FROM unnest(i.indoption::int2[]) o WHERE o <> 0)
             AS plain) k
  WHERE i.indrelid = to_regclass(:'table')),
want(role, name, file) AS (
  SELECT * FROM (
    VALUES ('due', 'outbox_event_due_idx', '001_outbox_event.sql'),
           ('unpublished', 'outbox_event_agg_unpublished_idx', '007_guard_split.sql'),
           ('published', 'outbox_event_agg_published_idx', '007_guard_split.sql'),
           ('retention', 'outbox_event_retention_idx', '001_outbox_event.sql')) v
  WHERE v.column1 = ANY ($1::text[])),
lacking AS (
  SELECT w.* FROM want w
  WHERE NOT EXISTS (SELECT 1 FROM idx x WHERE x.role = w.role AND x.valid))
-- none of the role, and no index of its name that serves no role
SELECT w.name, w.file, 'missing'
FROM lacking w
WHERE NOT EXISTS (SELECT 1 FROM idx x
                  WHERE x.role = w.role OR (x.name = w.name AND x.role IS NULL))
UNION ALL
-- an index of the file's name serving another role is that role's: the
-- lacking one is missing, and rebuilding that index would lose the other
SELECT x.name, w.file, 'different'
FROM lacking w JOIN idx x ON x.name = w.name AND x.role IS NULL
UNION ALL
SELECT x.name, w.file, CASE WHEN x.building THEN 'building' ELSE 'invalid' END
FROM lacking w JOIN idx x ON x.role = w.role
UNION ALL
SELECT x.name, '007_guard_split.sql',
       CASE WHEN NOT x.valid THEN 'old_invalid'
            WHEN EXISTS (SELECT 1 FROM lacking l
                         WHERE l.role IN ('unpublished', 'published')) THEN 'in_use'
            ELSE 'unused' END
FROM idx x
WHERE x.role = 'old' AND 'old' = ANY ($1::text[])
