-- 006_guard_index: outbox_event_aggregate_version_key keeps its columns but
-- leads with aggregate_id, which tells rows apart at the first column (cheaper
-- for every insert and every mark), and outbox_event_unpublished_idx, the
-- guard index of the relay's first design, goes: 007_guard_split.sql builds
-- the guard indexes the lock statements probe (docs/DESIGN.md, "The outbox
-- table"). Where this migration ran before 007 existed it built
-- outbox_event_agg_idx, which 007 keeps for the relays that probe it.
--
-- Safe to apply twice, and a no-op on a table the current 001 created. On a
-- table that needs it, it builds the unique index while holding the table
-- against writes (the application's inserts wait): for a large table, build
-- it first by hand, with the same definition, and the migration keeps it:
--   CREATE UNIQUE INDEX CONCURRENTLY outbox_event_aggregate_version_key_006 ON outbox_event
--     (aggregate_id, aggregate_version, aggregate_type, tenant_id, event_type);
-- Relays of the first design lose the index their probes used: apply it with
-- 007 and upgrade them.

DO $$
DECLARE
    t regclass := to_regclass('outbox_event');
    s name;
    key_cols text;
BEGIN
    IF t IS NULL THEN
        RETURN;
    END IF;
    SET LOCAL lock_timeout = '5s';
    SELECT n.nspname INTO s FROM pg_class r JOIN pg_namespace n ON n.oid = r.relnamespace
    WHERE r.oid = t;

    SELECT string_agg(a.attname, ',' ORDER BY k.n) INTO key_cols
    FROM pg_constraint c
    CROSS JOIN LATERAL unnest(c.conkey) WITH ORDINALITY AS k(attnum, n)
    JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = k.attnum
    WHERE c.conrelid = t AND c.conname = 'outbox_event_aggregate_version_key';
    IF key_cols IS DISTINCT FROM
       'aggregate_id,aggregate_version,aggregate_type,tenant_id,event_type' THEN
        IF to_regclass(quote_ident(s) || '.outbox_event_aggregate_version_key_006') IS NULL THEN
            EXECUTE format('CREATE UNIQUE INDEX outbox_event_aggregate_version_key_006 ON %s'
                           ' (aggregate_id, aggregate_version, aggregate_type, tenant_id,'
                           ' event_type)', t);
        END IF;
        IF key_cols IS NOT NULL THEN
            EXECUTE format('ALTER TABLE %s DROP CONSTRAINT outbox_event_aggregate_version_key', t);
        END IF;
        EXECUTE format('ALTER TABLE %s ADD CONSTRAINT outbox_event_aggregate_version_key'
                       ' UNIQUE USING INDEX outbox_event_aggregate_version_key_006', t);
    END IF;

    IF to_regclass(quote_ident(s) || '.outbox_event_unpublished_idx') IS NOT NULL THEN
        EXECUTE format('DROP INDEX %I.outbox_event_unpublished_idx', s);
    END IF;
END
$$;
