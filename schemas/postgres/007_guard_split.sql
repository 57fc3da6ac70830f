-- 007_guard_split: the guard index in two partial indexes, unpublished and
-- published versions (docs/DESIGN.md, "The outbox table"). The lock
-- statement finds an aggregate's highest published version in one descent,
-- however many unpublished versions lie above it, and tells a late version
-- by it alone, whatever the state of the versions between (another lock
-- statement may hold one locked, unseen, to go DEAD as late).
--
-- Safe to apply twice, and a no-op on a table the current 001 created. It
-- keeps outbox_event_agg_idx, which relays of earlier versions probe (without
-- it their lock statements would scan the table), so it can be applied
-- before a rolling upgrade, as the chart's hook does; once every relay runs
-- this version nothing reads that index, and every insert and every mark
-- still writes an entry in it: drop it then, by hand,
--   DROP INDEX CONCURRENTLY outbox_event_agg_idx;
-- It builds two indexes while holding the table against writes (the
-- application's inserts wait): for a large table, build them first by hand,
-- with the same definitions, and the migration keeps them:
--   CREATE INDEX CONCURRENTLY outbox_event_agg_unpublished_idx ON outbox_event
--     (hashtextextended(aggregate_id, hashtextextended(aggregate_type,
--        hashtextextended(tenant_id, 0))), aggregate_version)
--     WHERE published_at IS NULL;
--   CREATE INDEX CONCURRENTLY outbox_event_agg_published_idx ON outbox_event
--     (hashtextextended(aggregate_id, hashtextextended(aggregate_type,
--        hashtextextended(tenant_id, 0))), aggregate_version)
--     WHERE published_at IS NOT NULL;

DO $$
DECLARE
    t regclass := to_regclass('outbox_event');
    s name;
    ix record;
BEGIN
    IF t IS NULL THEN
        RETURN;
    END IF;
    SET LOCAL lock_timeout = '5s';
    SELECT n.nspname INTO s FROM pg_class r JOIN pg_namespace n ON n.oid = r.relnamespace
    WHERE r.oid = t;

    FOR ix IN
        SELECT name, pred FROM (VALUES
            ('outbox_event_agg_unpublished_idx', 'published_at IS NULL'),
            ('outbox_event_agg_published_idx', 'published_at IS NOT NULL')) AS v(name, pred)
    LOOP
        -- an invalid index (a CONCURRENTLY build that failed) is built again
        IF NOT EXISTS (
            SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
            WHERE i.indrelid = t AND c.relname = ix.name AND i.indisvalid) THEN
            IF to_regclass(format('%I.%I', s, ix.name)) IS NOT NULL THEN
                EXECUTE format('DROP INDEX %I.%I', s, ix.name);
            END IF;
            EXECUTE format('CREATE INDEX %I ON %s'
                           ' (hashtextextended(aggregate_id, hashtextextended(aggregate_type,'
                           ' hashtextextended(tenant_id, 0))), aggregate_version) WHERE %s',
                           ix.name, t, ix.pred);
        END IF;
    END LOOP;
END
$$;
