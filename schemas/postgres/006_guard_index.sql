-- 006_guard_index: the indexes of the relay's second design (docs/DESIGN.md,
-- "The outbox table"):
--   - outbox_event_agg_idx, an aggregate's versions by a 64-bit key, which the
--     lock statements' guard probes (integers to compare, not three texts),
--     replaces outbox_event_unpublished_idx;
--   - outbox_event_aggregate_version_key keeps its columns but leads with
--     aggregate_id, which tells rows apart at the first column (cheaper for
--     every insert and every mark).
--
-- Safe to apply twice, and a no-op on a table the current 001 created. On a
-- table that needs it, it builds two indexes while holding the table against
-- writes (the application's inserts wait): for a large table, build them
-- first by hand, with the same definitions, and the migration keeps them:
--   CREATE INDEX CONCURRENTLY outbox_event_agg_idx ON outbox_event
--     (hashtextextended(aggregate_id, hashtextextended(aggregate_type,
--        hashtextextended(tenant_id, 0))), aggregate_version, (published_at IS NULL));
--   CREATE UNIQUE INDEX CONCURRENTLY outbox_event_aggregate_version_key_006 ON outbox_event
--     (aggregate_id, aggregate_version, aggregate_type, tenant_id, event_type);
-- Apply it before upgrading the relays; relays of the first design keep
-- working after it, more slowly (their probes lose the index they used).

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

    -- 007 replaces this index: never build it again
    IF to_regclass(quote_ident(s) || '.outbox_event_agg_idx') IS NULL
       AND to_regclass(quote_ident(s) || '.outbox_event_agg_unpublished_idx') IS NULL THEN
        EXECUTE format('CREATE INDEX outbox_event_agg_idx ON %s'
                       ' (hashtextextended(aggregate_id, hashtextextended(aggregate_type,'
                       ' hashtextextended(tenant_id, 0))), aggregate_version,'
                       ' (published_at IS NULL))', t);
    END IF;

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
