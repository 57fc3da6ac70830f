-- 003_park_blocked: lets the sweeper park PENDING and FAILED versions that
-- wait behind a DEAD version of their aggregate at available_at 'infinity',
-- out of the lock scan's range (last_error_code 'BLOCKED'; see
-- docs/DESIGN.md, "The sweeper"). It widens outbox_event_parked_check
-- to the definition in the current 001.
--
-- Safe to apply twice, and a no-op (without a NOTICE) on a table the current
-- 001 created. The new check only allows more than the old one, so existing
-- rows meet it: it is added NOT VALID (no table scan), and relays may keep
-- running. It still needs a moment's exclusive lock on the table, which waits
-- for open transactions that wrote to it and holds up later writers meanwhile:
-- the lock_timeout below gives up after 5 s instead (apply it again then).
-- `ALTER TABLE outbox_event VALIDATE CONSTRAINT outbox_event_parked_check`
-- checks the old rows too, if wanted. Apply it before upgrading the sweeper:
-- until then, the new sweeper's parking step fails (logged, retention goes on).

DO $$
DECLARE
    t regclass := to_regclass('outbox_event');
BEGIN
    IF t IS NULL OR EXISTS (
        SELECT 1 FROM pg_constraint WHERE conrelid = t
        AND conname = 'outbox_event_parked_check'
        AND pg_get_constraintdef(oid) LIKE '%BLOCKED%') THEN
        RETURN;
    END IF;
    SET LOCAL lock_timeout = '5s';
    IF EXISTS (SELECT 1 FROM pg_constraint WHERE conrelid = t
               AND conname = 'outbox_event_parked_check') THEN
        ALTER TABLE outbox_event DROP CONSTRAINT outbox_event_parked_check;
    END IF;
    ALTER TABLE outbox_event ADD CONSTRAINT outbox_event_parked_check
        CHECK (status NOT IN ('PENDING', 'FAILED', 'PUBLISHING')
               OR available_at <> 'infinity'
               OR (status <> 'PUBLISHING'
                   AND last_error_code IS NOT DISTINCT FROM 'BLOCKED')) NOT VALID;
END
$$;
