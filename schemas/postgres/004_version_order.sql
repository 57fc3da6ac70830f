-- 004_version_order: what per-aggregate order needs when transactions commit
-- out of version order (docs/DESIGN.md, "Per-aggregate order"):
--   - txid, the inserting transaction (pg_current_xact_id() by default): a
--     version with no predecessor in the table goes out only once every
--     transaction older than it has ended, so a predecessor still being
--     written cannot be overtaken;
--   - outbox_event_retention_idx replaces outbox_event_published_idx: the
--     sweeper keeps each aggregate's latest published row (the guard tells a
--     gap from an aggregate's first version by it) and parks it at
--     available_at 'infinity', out of the retention scan.
--
-- Safe to apply twice, and a no-op (without a NOTICE) on a table the current
-- 001 created. Adding a column without a stored default and setting a default
-- are catalog changes (no table rewrite; old rows have txid NULL, which counts
-- as old). Building the new index reads every published row: apply it with the
-- sweepers stopped (relays may run; the lock_timeout gives up after 5 s if the
-- table is busy, apply it again then).

DO $$
DECLARE
    t regclass := to_regclass('outbox_event');
    s name;
BEGIN
    IF t IS NULL THEN
        RETURN;
    END IF;
    SET LOCAL lock_timeout = '5s';
    SELECT n.nspname INTO s FROM pg_class r JOIN pg_namespace n ON n.oid = r.relnamespace
    WHERE r.oid = t;
    IF NOT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = t AND attname = 'txid'
                   AND NOT attisdropped) THEN
        ALTER TABLE outbox_event ADD COLUMN txid xid8 NULL;
    END IF;
    ALTER TABLE outbox_event ALTER COLUMN txid SET DEFAULT pg_current_xact_id();
    IF to_regclass(quote_ident(s) || '.outbox_event_retention_idx') IS NULL THEN
        EXECUTE format('CREATE INDEX outbox_event_retention_idx ON %s (published_at)'
                       ' WHERE published_at IS NOT NULL AND available_at <> ''infinity''', t);
    END IF;
    IF to_regclass(quote_ident(s) || '.outbox_event_published_idx') IS NOT NULL THEN
        EXECUTE format('DROP INDEX %I.outbox_event_published_idx', s);
    END IF;
END
$$;
