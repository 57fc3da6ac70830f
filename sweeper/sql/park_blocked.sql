-- park_blocked: parks the PENDING and FAILED versions above the lowest DEAD
-- version of their aggregate out of the lock scan (docs/DESIGN.md, "The
-- sweeper", step 2): available_at 'infinity', last_error_code BLOCKED. A
-- LATE_VERSION row holds nothing: its place in the order is already lost (a
-- later version reached Kafka before it was committed), so the versions
-- after it follow the published ones.
--   $1 int  rows at most
-- Returns the number of rows parked.
--
-- Plan: one read of the parked range (DEAD and parked rows) finds each DEAD
-- aggregate and its highest parked version; parking walks on from there in
-- version order, so a long queue is parked in one pass over it. A version a
-- lock statement holds (SKIP LOCKED), or one below the highest parked
-- version (the relays' lock statements park the versions they meet, not in
-- version order), stays due: the lock statement that meets it parks it. The
-- rows go to the UPDATE as an array, found by primary key: no join whose
-- plan a misestimate could turn quadratic.
WITH dead AS MATERIALIZED (
  SELECT tenant_id, aggregate_type, aggregate_id,
         min(aggregate_version) FILTER (
           WHERE status = 'DEAD' AND last_error_code IS DISTINCT FROM 'LATE_VERSION') AS v,
         max(aggregate_version) FILTER (WHERE status <> 'DEAD') AS parked
  FROM :table
  WHERE published_at IS NULL AND available_at = 'infinity'
  GROUP BY 1, 2, 3
  HAVING bool_or(status = 'DEAD' AND last_error_code IS DISTINCT FROM 'LATE_VERSION'))
UPDATE :table o
SET available_at = 'infinity', last_error_code = 'BLOCKED',
    last_error_message = 'parked behind a DEAD version of its aggregate'
      || ' (due again when that is requeued, published or deleted)',
    updated_at = clock_timestamp()
WHERE o.outbox_id = ANY (ARRAY(
    SELECT x.outbox_id
    FROM dead d
    CROSS JOIN LATERAL (
      SELECT s.outbox_id
      FROM :table s
      WHERE s.tenant_id = d.tenant_id AND s.aggregate_type = d.aggregate_type
        AND s.aggregate_id = d.aggregate_id
        AND s.published_at IS NULL
        AND s.aggregate_version > greatest(d.v, d.parked)
        AND s.status IN ('PENDING', 'FAILED') AND s.available_at <> 'infinity'
      ORDER BY s.aggregate_version
      LIMIT $1
      FOR UPDATE SKIP LOCKED) x
    LIMIT $1))
  AND o.status IN ('PENDING', 'FAILED')
