-- blockers: the sessions a statement of this relay waits for.
--   $1 int  the backend pid of the relay's connection that waits
-- Returns per blocker: pid, database, application_name, state, what it
-- waits for itself, its transaction's age in seconds, and the first words
-- of its statement (the command, never its values).
SELECT a.pid, a.datname::text, a.application_name, a.state,
       coalesce(a.wait_event_type || ':' || a.wait_event, ''),
       coalesce(extract(epoch FROM now() - a.xact_start), 0)::float8,
       coalesce(substring(a.query FROM '^\s*([A-Za-z]+(\s+[A-Za-z]+)?)'), '')
FROM pg_stat_activity a
WHERE a.pid = ANY (pg_blocking_pids($1))
