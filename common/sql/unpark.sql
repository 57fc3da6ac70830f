-- unpark: makes due again the versions parked behind a DEAD version once no
-- DEAD version of their aggregate is below them (requeued, deleted or
-- published by hand): the sweeper's parking step (docs/DESIGN.md, "The
-- sweeper", step 2) runs it, and so does the relay after a table sample that
-- counted parked versions. The relay parks such versions in its lock
-- statement; it returns them without waiting for a sweep, also those a lock
-- statement parked while an operator requeued their DEAD version in the same
-- moment (no sweeper need run for them to go). A LATE_VERSION row holds
-- nothing (park_blocked.sql says why).
--   $1 int  rows at most
--   $2 int  1: every parked version, whatever is below it (OUTBOX_ORDERING
--           none, where nothing is held); 0: those no DEAD version holds
-- Returns the number of rows made due.
--
-- Plan: one read and sort of the parked range (available_at 'infinity' among
-- the unpublished rows: DEAD and parked rows, in the due index), then the
-- update of the rows found, by primary key or over the parked range again.
-- Relays running this at once with the same plan lock the rows in the same
-- index order and wait for each other; a deadlock between two plans fails one
-- statement, which the next sample runs again.
WITH due AS (
  UPDATE :table o
  SET available_at = now(), last_error_code = NULL, last_error_message = NULL,
      updated_at = clock_timestamp()
  WHERE o.outbox_id = ANY (ARRAY(
    SELECT inf.outbox_id
    FROM (SELECT p.outbox_id, p.status, p.aggregate_version,
                 min(p.aggregate_version) FILTER (
                   WHERE p.status = 'DEAD' AND p.last_error_code IS DISTINCT FROM 'LATE_VERSION')
                   OVER (PARTITION BY p.tenant_id, p.aggregate_type, p.aggregate_id) AS dead_v
          FROM :table p
          WHERE p.published_at IS NULL AND p.available_at = 'infinity') inf
    WHERE inf.status IN ('PENDING', 'FAILED')
      AND (inf.dead_v IS NULL OR inf.aggregate_version < inf.dead_v OR $2 = 1)
    LIMIT $1))
    AND o.published_at IS NULL AND o.available_at = 'infinity'
    AND o.status IN ('PENDING', 'FAILED')
  RETURNING 1)
SELECT count(*) FROM due
