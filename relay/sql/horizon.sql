-- horizon: the oldest transaction with a transaction id still open on the
-- server, in any database (docs/DESIGN.md, "Per-aggregate order"): under
-- OUTBOX_ORDERING=increasing every row written after it began waits for it
-- to end, under aggregate an aggregate's first version does.
-- Returns at most one row: its pid (NULL for a prepared transaction),
-- database, application_name, state, age in seconds, and whether it holds
-- rows back now (one of the newest 1000 due rows was written after it began).
WITH horizon AS MATERIALIZED (
  SELECT pg_snapshot_xmin(pg_current_snapshot()) AS xmin),
oldest AS (
  SELECT a.pid, a.datname::text AS datname, a.application_name, a.state,
         extract(epoch FROM now() - a.xact_start)::float8 AS age
  FROM pg_stat_activity a
  WHERE a.backend_xid IS NOT NULL AND a.pid <> pg_backend_pid()
  UNION ALL
  SELECT NULL, p.database::text, 'prepared transaction ' || p.gid, 'prepared',
         extract(epoch FROM now() - p.prepared)::float8
  FROM pg_prepared_xacts p
  ORDER BY 5 DESC
  LIMIT 1)
SELECT o.pid, o.datname, o.application_name, o.state, o.age,
       EXISTS (SELECT 1
               FROM (SELECT t.txid FROM :table t
                     WHERE t.published_at IS NULL AND t.status IN ('PENDING', 'FAILED')
                       AND t.available_at <= now()
                     ORDER BY t.available_at DESC
                     LIMIT 1000) newest
               WHERE newest.txid >= (SELECT xmin FROM horizon))
FROM oldest o
