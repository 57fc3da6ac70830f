-- 005_notify_channel_bytes: the NOTIFY trigger cuts its channel name to 63
-- bytes, not 63 characters. The name is '<schema>.<table>'; PostgreSQL refuses
-- a channel name of 64 bytes or more, so with a long non-ASCII schema name an
-- earlier trigger (which cut to 63 characters) made every INSERT into the
-- table fail ("channel name too long"). The cut is on a character boundary,
-- as the relay cuts the name it LISTENs on.
--
-- Safe to apply twice, and a no-op on a table the current 001 created (it
-- replaces the function with the same one). Replacing a function takes no
-- lock on the table: apply it while relays and the application run.

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
