-- reset_stale: locks older than the lock timeout go back (docs/DESIGN.md,
-- "The sweeper", step 1): FAILED with STALE_LOCK and due now, or DEAD
-- (parked) once their attempts are used up, so a row that kills every relay
-- that takes it cannot loop, whatever the relays' ids.
--   $1 int  OUTBOX_LOCK_TIMEOUT_S
--   $2 int  rows at most
--   $3 int  OUTBOX_MAX_ATTEMPTS
-- Returns the number of rows reset, and of those DEAD.
--
-- Plan: the due index (none covers locked_at): a row is locked only once
-- due, so its available_at is older than its lock; rows another statement
-- holds are skipped.
WITH stale AS (
  SELECT outbox_id
  FROM :table
  WHERE published_at IS NULL
    AND available_at < now() - $1 * interval '1 second'
    AND status = 'PUBLISHING'
    AND locked_at < now() - $1 * interval '1 second'
  ORDER BY available_at, aggregate_version
  LIMIT $2
  FOR UPDATE SKIP LOCKED),
reset AS (
  UPDATE :table o
  SET status = CASE WHEN o.attempt_count >= $3 THEN 'DEAD' ELSE 'FAILED' END,
      available_at = CASE WHEN o.attempt_count >= $3 THEN 'infinity'::timestamptz
                          ELSE now() END,
      last_error_code = 'STALE_LOCK',
      last_error_message = 'lock of ' || coalesce(o.locked_by, '?')
        || ' expired after ' || $1 || ' s'
        || CASE WHEN o.attempt_count >= $3
                THEN ', attempt ' || o.attempt_count || ' of ' || $3
                     || ': the row may be what stops its relays'
                ELSE '' END,
      locked_by = NULL, locked_at = NULL, updated_at = clock_timestamp()
  FROM stale
  WHERE o.outbox_id = stale.outbox_id
  RETURNING o.status)
SELECT count(*), count(*) FILTER (WHERE status = 'DEAD')
FROM reset
