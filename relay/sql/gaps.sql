-- gaps: version gaps (docs/DESIGN.md, "Per-aggregate order"): among the
-- oldest 10000 due rows inserted more than $1 s ago, the lowest of each
-- aggregate whose previous version in the table (a LATE_VERSION row is not
-- in the order, as in lock.sql) is published and below it by more than one.
-- Held rows stay due and old, so they are among the oldest; reading at most
-- 10000 keeps the cost bounded whatever the backlog.
--   $1 int  seconds a row must have waited
--   $2 int  gaps returned at most, oldest first
-- Returns per gap: tenant_id, aggregate_type, aggregate_id, the held version,
-- the previous version, how long it has been held (s), the aggregate's key,
-- and the count of all the gaps found.
WITH candidates AS MATERIALIZED (
  SELECT o.tenant_id, o.aggregate_type, o.aggregate_id, o.aggregate_version AS v,
         o.created_at,
         hashtextextended(o.aggregate_id, hashtextextended(o.aggregate_type,
           hashtextextended(o.tenant_id, 0))) AS k
  FROM :table o
  WHERE o.published_at IS NULL AND o.status IN ('PENDING', 'FAILED')
    AND o.available_at <= now() AND o.created_at < now() - $1 * interval '1 second'
  ORDER BY o.available_at, o.aggregate_version
  LIMIT 10000),
lowest AS (
  SELECT DISTINCT ON (c.k, c.tenant_id, c.aggregate_type, c.aggregate_id) c.*
  FROM candidates c
  ORDER BY c.k, c.tenant_id, c.aggregate_type, c.aggregate_id, c.v),
probed AS (
  -- the highest published version below the lowest, and whether an
  -- unpublished version (not a late one) lies between them: then the lowest
  -- waits for that one, not for a gap
  SELECT l.*, prev.v AS prev_v
  FROM lowest l
  CROSS JOIN LATERAL (
    SELECT p.aggregate_version AS v
    FROM :table p
    WHERE p.published_at IS NOT NULL
      AND hashtextextended(p.aggregate_id, hashtextextended(p.aggregate_type,
            hashtextextended(p.tenant_id, 0))) = l.k
      AND p.aggregate_version < l.v
      AND p.tenant_id = l.tenant_id COLLATE "C"
      AND p.aggregate_type = l.aggregate_type COLLATE "C"
      AND p.aggregate_id = l.aggregate_id COLLATE "C"
    ORDER BY hashtextextended(p.aggregate_id, hashtextextended(p.aggregate_type,
               hashtextextended(p.tenant_id, 0))) DESC,
             p.aggregate_version DESC
    LIMIT 1) prev
  WHERE prev.v + 1 < l.v
    -- in index order, so that no statistics make the due index look cheaper
    AND (SELECT p.aggregate_version
         FROM :table p
         WHERE p.published_at IS NULL
           AND hashtextextended(p.aggregate_id, hashtextextended(p.aggregate_type,
                 hashtextextended(p.tenant_id, 0))) = l.k
           AND p.aggregate_version < l.v AND p.aggregate_version >= prev.v
           AND (p.status NOT IN ('DEAD', 'PUBLISHING')
                OR p.last_error_code IS DISTINCT FROM 'LATE_VERSION')
           AND p.tenant_id = l.tenant_id COLLATE "C"
           AND p.aggregate_type = l.aggregate_type COLLATE "C"
           AND p.aggregate_id = l.aggregate_id COLLATE "C"
         ORDER BY hashtextextended(p.aggregate_id, hashtextextended(p.aggregate_type,
                    hashtextextended(p.tenant_id, 0))) DESC,
                  p.aggregate_version DESC
         LIMIT 1) IS NULL)
SELECT g.tenant_id, g.aggregate_type, g.aggregate_id, g.v, g.prev_v,
       extract(epoch FROM now() - g.created_at)::float8, g.k, count(*) OVER ()
FROM probed g
ORDER BY g.created_at
LIMIT $2
