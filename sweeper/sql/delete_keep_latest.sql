-- delete_keep_latest: delete_published, keeping each aggregate's latest
-- published row: the consecutive-versions guard tells a gap from an
-- aggregate's first version by it (OUTBOX_RETENTION_KEEP_LATEST). A row
-- below a published version of its aggregate goes; a latest one is parked at
-- available_at 'infinity', out of this scan for good, and the row it
-- replaces as its aggregate's latest goes.
--   $1 bigint  OUTBOX_RETENTION_S
--   $2 int     rows at most
-- Returns the number of rows deleted, and of rows looked at.
--
-- Plan: outbox_event_retention_idx for the candidates; whether a published
-- version lies above each is one probe of outbox_event_agg_published_idx
-- per row (a subquery with a LIMIT: the planner, left free in the sweeper's
-- session, never makes it a join over the table).
WITH cand AS MATERIALIZED (
  SELECT o.outbox_id, o.tenant_id, o.aggregate_type, o.aggregate_id, o.aggregate_version,
         (SELECT true
          FROM :table p
          WHERE p.published_at IS NOT NULL
            AND hashtextextended(p.aggregate_id, hashtextextended(p.aggregate_type,
                  hashtextextended(p.tenant_id, 0)))
              = hashtextextended(o.aggregate_id, hashtextextended(o.aggregate_type,
                  hashtextextended(o.tenant_id, 0)))
            AND p.aggregate_version > o.aggregate_version
            AND p.tenant_id = o.tenant_id COLLATE "C"
            AND p.aggregate_type = o.aggregate_type COLLATE "C"
            AND p.aggregate_id = o.aggregate_id COLLATE "C"
          ORDER BY hashtextextended(p.aggregate_id, hashtextextended(p.aggregate_type,
                     hashtextextended(p.tenant_id, 0))), p.aggregate_version
          LIMIT 1) AS superseded
  FROM :table o
  WHERE o.published_at IS NOT NULL AND o.available_at <> 'infinity'
    AND o.published_at < now() - $1 * interval '1 second'
  ORDER BY o.published_at
  LIMIT $2
  FOR UPDATE SKIP LOCKED),
kept AS (
  UPDATE :table o
  SET available_at = 'infinity', updated_at = clock_timestamp()
  FROM cand c
  WHERE o.outbox_id = c.outbox_id AND c.superseded IS NOT TRUE
  RETURNING 1),
gone AS (
  DELETE FROM :table o
  WHERE o.outbox_id = ANY (ARRAY(
      SELECT outbox_id FROM cand WHERE superseded
      UNION ALL
      SELECT k.outbox_id
      FROM cand c
      CROSS JOIN LATERAL (
        SELECT p.outbox_id
        FROM :table p
        WHERE p.tenant_id = c.tenant_id AND p.aggregate_type = c.aggregate_type
          AND p.aggregate_id = c.aggregate_id
          AND p.aggregate_version < c.aggregate_version
          AND p.published_at IS NOT NULL AND p.available_at = 'infinity') k))
    AND o.published_at IS NOT NULL
  RETURNING 1)
SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM cand)
