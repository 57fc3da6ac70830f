-- sample: the table gauges (docs/DESIGN.md, "Observability"), exact over the
-- unpublished rows (the due index's range), never a scan of the published.
-- Returns one row: PENDING, PUBLISHING, PUBLISHED (the statistics collector's
-- live rows less the unpublished: an estimate), FAILED, DEAD, the age in
-- seconds of the oldest PENDING or FAILED row, the versions parked behind a
-- DEAD one (by a relay's lock statement or the sweeper), and the aggregates a
-- DEAD version holds (a LATE_VERSION row holds none).
SELECT count(*) FILTER (WHERE o.status = 'PENDING')::float8,
       count(*) FILTER (WHERE o.status = 'PUBLISHING')::float8,
       greatest(coalesce((SELECT s.n_live_tup FROM pg_stat_user_tables s
                          WHERE s.relid = to_regclass(:'table')), 0) - count(*), 0)::float8,
       count(*) FILTER (WHERE o.status = 'FAILED')::float8,
       count(*) FILTER (WHERE o.status = 'DEAD')::float8,
       coalesce(extract(epoch FROM now() - min(o.created_at)
                FILTER (WHERE o.status IN ('PENDING', 'FAILED'))), 0)::float8,
       count(*) FILTER (WHERE o.status IN ('PENDING', 'FAILED')
                        AND o.available_at = 'infinity')::float8,
       count(DISTINCT (o.tenant_id, o.aggregate_type, o.aggregate_id))
         FILTER (WHERE o.status = 'DEAD'
                 AND o.last_error_code IS DISTINCT FROM 'LATE_VERSION')::float8
FROM :table o
WHERE o.published_at IS NULL /* test: sample pause */
