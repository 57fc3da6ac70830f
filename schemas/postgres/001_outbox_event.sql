-- 001_outbox_event: the outbox table, its indexes and the NOTIFY trigger.
--
-- Safe to apply twice, silently (what exists already is left as it is, without
-- a NOTICE). Names are unqualified: the table is created in the first schema of
-- search_path, so the same file serves `public.outbox_event` and per-test
-- schemas alike.

DO $$
BEGIN
IF to_regclass(format('%I.outbox_event', current_schema())) IS NOT NULL THEN
    RETURN;
END IF;
CREATE TABLE outbox_event (
    outbox_id          uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    tenant_id          text        NOT NULL DEFAULT 'default',
    aggregate_type     text        NOT NULL,
    aggregate_id       text        NOT NULL,
    aggregate_version  bigint      NOT NULL,
    event_type         text        NOT NULL,
    event_version      int         NOT NULL DEFAULT 1,
    topic_name         text        NULL,
    partition_key      text        NULL,
    event_key          text        NULL,
    payload_json       jsonb       NULL,
    headers_json       jsonb       NOT NULL DEFAULT '{}',
    correlation_id     text        NULL,
    causation_id       text        NULL,
    trace_id           text        NULL,
    occurred_at        timestamptz NOT NULL DEFAULT clock_timestamp(),
    available_at       timestamptz NOT NULL DEFAULT now(),
    status             text        NOT NULL DEFAULT 'PENDING',
    attempt_count      int         NOT NULL DEFAULT 0,
    last_attempt_at    timestamptz NULL,
    published_at       timestamptz NULL,
    locked_at          timestamptz NULL,
    locked_by          text        NULL,
    last_error_code    text        NULL,
    last_error_message text        NULL,
    created_at         timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at         timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- The inserting transaction: a version committed late is told apart
    -- from an aggregate's first one (docs/DESIGN.md, "Per-aggregate order").
    -- Set by the default; NULL (rows older than this column) counts as old.
    txid               xid8        NULL DEFAULT pg_current_xact_id(),
    CONSTRAINT outbox_event_status_check
        CHECK (status IN ('PENDING', 'PUBLISHING', 'PUBLISHED', 'FAILED', 'DEAD')),
    -- aggregate_id first: it tells rows apart at the first column, so the
    -- index's comparisons (every insert, every mark) rarely read the others.
    CONSTRAINT outbox_event_aggregate_version_key
        UNIQUE (aggregate_id, aggregate_version, aggregate_type, tenant_id, event_type),
    -- The partial indexes below tell published from unpublished rows by
    -- published_at, not by status (see there): the two must agree.
    CONSTRAINT outbox_event_published_at_check
        CHECK ((status = 'PUBLISHED') = (published_at IS NOT NULL)),
    -- A DEAD row is parked at available_at 'infinity', out of every lock
    -- scan's range; whoever requeues it must give it a real due time (a row
    -- waiting for, or in, a relay never has that one). The one exception:
    -- the versions behind a DEAD one are parked there too (by a relay's lock
    -- statement or the sweeper), marked last_error_code 'BLOCKED', and made
    -- due again when it is gone.
    CONSTRAINT outbox_event_parked_check
        CHECK (status NOT IN ('PENDING', 'FAILED', 'PUBLISHING')
               OR available_at <> 'infinity'
               OR (status <> 'PUBLISHING'
                   AND last_error_code IS NOT DISTINCT FROM 'BLOCKED'))
) WITH (fillfactor = 50);
END
$$;

-- No index mentions status, locked_by, locked_at, last_attempt_at,
-- attempt_count or updated_at, the only columns the relay's lock statement
-- changes on the rows it locks (it moves available_at only for the rare rows
-- it defers or parks): so locking a row into PUBLISHING is a HOT update (no index entry
-- written) whenever its page has room, which the table's fillfactor of 50
-- leaves for rows a backlog filled pages with. Published and unpublished rows
-- are told apart by published_at (outbox_event_published_at_check keeps it in
-- step with status); the mark to PUBLISHED is the one update per row that
-- writes index entries. This halves the index work per row, which is what
-- lets PostgreSQL keep up with the relay.

-- The indexes, in the table's schema; each is built unless it exists.
DO $$
DECLARE
    s name := (SELECT n.nspname FROM pg_class r JOIN pg_namespace n
               ON n.oid = r.relnamespace WHERE r.oid = 'outbox_event'::regclass);
BEGIN
-- The relay's lock scan: unpublished rows in due-time order, lower versions
-- first among rows due at the same time. Partial, so its size follows the
-- unpublished backlog only, and in the ORDER BY's columns so a batch reads
-- about LIMIT entries instead of sorting every due row. In-flight (PUBLISHING)
-- rows are stepped over by the status filter; DEAD rows sit at available_at
-- 'infinity', past the scan's `available_at <= now()` bound.
IF to_regclass(format('%I.outbox_event_due_idx', s)) IS NULL THEN
    CREATE INDEX outbox_event_due_idx
        ON outbox_event (available_at, aggregate_version)
        WHERE published_at IS NULL;
END IF;

-- The per-aggregate guard: an aggregate's versions by a 64-bit key of
-- (tenant_id, aggregate_type, aggregate_id), so that the probes of the lock
-- statements compare integers, in two partial indexes: the unpublished
-- versions, and the published ones, whose highest is one descent away
-- however many unpublished versions lie above it (a version below it is
-- late, whatever the state of those between). Each row is in one of the
-- two: an insert writes one entry, and so does the mark to PUBLISHED. The
-- probes also check the three columns, so two aggregates with the same key
-- never decide for each other.
IF to_regclass(format('%I.outbox_event_agg_unpublished_idx', s)) IS NULL THEN
    CREATE INDEX outbox_event_agg_unpublished_idx
        ON outbox_event (hashtextextended(aggregate_id, hashtextextended(aggregate_type,
                           hashtextextended(tenant_id, 0))), aggregate_version)
        WHERE published_at IS NULL;
END IF;
IF to_regclass(format('%I.outbox_event_agg_published_idx', s)) IS NULL THEN
    CREATE INDEX outbox_event_agg_published_idx
        ON outbox_event (hashtextextended(aggregate_id, hashtextextended(aggregate_type,
                           hashtextextended(tenant_id, 0))), aggregate_version)
        WHERE published_at IS NOT NULL;
END IF;

-- The sweeper's retention delete, by publish time. Each aggregate's latest
-- published row is kept (the guard tells a gap from a first version by it)
-- and moved out of this index's range by available_at 'infinity', so the
-- delete never reads kept rows again. Its stale-lock scan uses
-- outbox_event_due_idx: a PUBLISHING row was due when it was locked, so a lock
-- older than the lock timeout belongs to a row due before that.
IF to_regclass(format('%I.outbox_event_retention_idx', s)) IS NULL THEN
    CREATE INDEX outbox_event_retention_idx
        ON outbox_event (published_at)
        WHERE published_at IS NOT NULL AND available_at <> 'infinity';
END IF;
END
$$;

-- One NOTIFY per inserting statement, on the channel '<schema>.<table>' cut to
-- at most 63 bytes (PostgreSQL's limit for a channel name) on a character
-- boundary, so idle relays wake at once. The relay LISTENs on the same name,
-- resolved from OUTBOX_TABLE and cut the same way.
CREATE OR REPLACE FUNCTION outbox_event_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    channel text := left(TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME, 63);
BEGIN
    WHILE octet_length(channel) > 63 LOOP
        channel := left(channel, -1);
    END LOOP;
    PERFORM pg_notify(channel, '');
    RETURN NULL;
END;
$$;

CREATE OR REPLACE TRIGGER outbox_event_notify_trg
    AFTER INSERT ON outbox_event
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_event_notify();
