-- take_back_own: rows this relay id holds in PUBLISHING that no batch of
-- this process has: locked before $2 (when the connection that locks now was
-- made) by an earlier process with the same id, or by a lock statement
-- whose answer a lost connection took with it (docs/DESIGN.md, "Status
-- machine" step 6). FAILED with STALE_LOCK and due now, or DEAD (parked)
-- once their attempts ($3) are used up, so a row that keeps killing its
-- relay cannot loop forever.
--   $1 text         relay id
--   $2 timestamptz  locks older than this
--   $3 int          OUTBOX_MAX_ATTEMPTS
--   $4 int          rows at most
-- Returns the number of rows taken back, and of those DEAD.
--
-- Plan: the due index over the due rows (no index covers locked_by, so the
-- lock stays a HOT update); rows another statement holds are skipped.
WITH own AS MATERIALIZED (
  SELECT o.ctid AS tid
  FROM :table o
  WHERE o.published_at IS NULL AND o.available_at <= now()
    AND o.status = 'PUBLISHING' AND o.locked_by = $1 AND o.locked_at < $2
  LIMIT $4
  FOR UPDATE OF o SKIP LOCKED),
back AS (
  UPDATE :table o
  SET status = CASE WHEN o.attempt_count >= $3 THEN 'DEAD' ELSE 'FAILED' END,
      available_at = CASE WHEN o.attempt_count >= $3 THEN 'infinity'::timestamptz
                          ELSE now() END,
      last_error_code = 'STALE_LOCK',
      last_error_message = 'lock taken back by the same relay id after a reconnect or restart'
        || CASE WHEN o.attempt_count >= $3
                THEN ', attempt ' || o.attempt_count || ' of ' || $3 ELSE '' END,
      locked_by = NULL, locked_at = NULL, updated_at = clock_timestamp()
  FROM own
  WHERE o.ctid = own.tid
  RETURNING o.status)
SELECT count(*), count(*) FILTER (WHERE status = 'DEAD') FROM back
