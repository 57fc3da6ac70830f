-- held: what the held aggregates keep back (docs/DESIGN.md, "Observability").
--   $1 bigint[]  the keys of the aggregates a gap holds (from gaps)
-- Returns one row: the age in seconds of the oldest due row of any other
-- aggregate (0 when none: what the critical page watches), and the
-- unpublished rows of the held aggregates.
SELECT coalesce((
         SELECT extract(epoch FROM now() - o.available_at)::float8
         FROM :table o
         WHERE o.published_at IS NULL AND o.status IN ('PENDING', 'FAILED')
           AND o.available_at <= now()
           AND hashtextextended(o.aggregate_id, hashtextextended(o.aggregate_type,
                 hashtextextended(o.tenant_id, 0))) <> ALL ($1::bigint[])
         ORDER BY o.available_at
         LIMIT 1), 0),
       (SELECT count(*)::float8
        FROM :table p
        WHERE hashtextextended(p.aggregate_id, hashtextextended(p.aggregate_type,
                hashtextextended(p.tenant_id, 0))) = ANY ($1::bigint[])
          AND p.published_at IS NULL)
