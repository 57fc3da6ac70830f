-- 002_hot_lock_upgrade: brings a table that an earlier 001 created (indexes
-- selecting rows by status, an index on locked_at, no CHECKs on published_at
-- or available_at) to the current 001: the lock statement is then a HOT
-- update (see 001 and docs/DESIGN.md).
--
-- Safe to apply twice, and a no-op (without a NOTICE) on a table the current
-- 001 created. On a table that needs it, it rewrites no heap but locks the
-- table while it parks DEAD rows, checks the constraints and rebuilds three
-- indexes: run it with the relays stopped. For a large table, build the indexes
-- by hand first with CREATE INDEX CONCURRENTLY under the names below (a valid
-- index of the right definition is kept).

DO $$
DECLARE
    t regclass := to_regclass('outbox_event');
    s name;
    ix record;
BEGIN
    IF t IS NULL THEN
        RETURN;
    END IF;
    SELECT n.nspname INTO s FROM pg_class r JOIN pg_namespace n ON n.oid = r.relnamespace
    WHERE r.oid = t;

    -- Rows must satisfy the constraints before they are added.
    UPDATE outbox_event SET available_at = 'infinity'
    WHERE status = 'DEAD' AND available_at <> 'infinity';
    UPDATE outbox_event SET published_at = updated_at
    WHERE status = 'PUBLISHED' AND published_at IS NULL;
    UPDATE outbox_event SET published_at = NULL
    WHERE status <> 'PUBLISHED' AND published_at IS NOT NULL;

    IF NOT EXISTS (SELECT 1 FROM pg_constraint WHERE conrelid = t
                   AND conname = 'outbox_event_published_at_check') THEN
        ALTER TABLE outbox_event ADD CONSTRAINT outbox_event_published_at_check
            CHECK ((status = 'PUBLISHED') = (published_at IS NOT NULL));
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_constraint WHERE conrelid = t
                   AND conname = 'outbox_event_parked_check') THEN
        ALTER TABLE outbox_event ADD CONSTRAINT outbox_event_parked_check
            CHECK (status NOT IN ('PENDING', 'FAILED', 'PUBLISHING')
                   OR available_at <> 'infinity');
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_class WHERE oid = t
                   AND 'fillfactor=50' = ANY(coalesce(reloptions, '{}'))) THEN
        -- applies to pages filled from now on
        ALTER TABLE outbox_event SET (fillfactor = 50);
    END IF;

    -- Indexes that still mention status (or are missing) are rebuilt.
    IF to_regclass('outbox_event_publishing_idx') IS NOT NULL THEN
        DROP INDEX outbox_event_publishing_idx;
    END IF;
    FOR ix IN
        SELECT name, def, pred FROM (VALUES
            ('outbox_event_due_idx', '(available_at, aggregate_version)',
             'published_at IS NULL'),
            ('outbox_event_unpublished_idx',
             '(tenant_id, aggregate_type, aggregate_id, aggregate_version)',
             'published_at IS NULL'),
            ('outbox_event_published_idx', '(published_at)', 'published_at IS NOT NULL'))
            AS v(name, def, pred)
    LOOP
        -- 004 replaced the retention index, 006 and 007 the guard's: never
        -- build the old ones again
        CONTINUE WHEN ix.name = 'outbox_event_published_idx' AND EXISTS (
            SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
            WHERE i.indrelid = t AND c.relname = 'outbox_event_retention_idx');
        CONTINUE WHEN ix.name = 'outbox_event_unpublished_idx' AND EXISTS (
            SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
            WHERE i.indrelid = t AND c.relname IN ('outbox_event_agg_idx',
                                                   'outbox_event_agg_unpublished_idx'));
        IF NOT EXISTS (
            SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
            WHERE i.indrelid = t AND c.relname = ix.name AND i.indisvalid
              AND pg_get_expr(i.indpred, i.indrelid) = '(' || ix.pred || ')') THEN
            IF to_regclass(format('%I.%I', s, ix.name)) IS NOT NULL THEN
                EXECUTE format('DROP INDEX %I.%I', s, ix.name);
            END IF;
            EXECUTE format('CREATE INDEX %I ON %s %s WHERE %s', ix.name, t, ix.def, ix.pred);
        END IF;
    END LOOP;
END
$$;
