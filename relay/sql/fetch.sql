-- fetch: the content of rows this relay holds, by the ctid their lock
-- returned, read without locks (docs/DESIGN.md, "Memory").
--   $1 tid[]   the rows
--   $2 text    relay id: a row another relay or the sweeper took since is not read
--   $3 bigint  bytes: rows come while the text of those before them stays
--              below this (the first row always comes)
--   $4 bigint  largest row: a row whose text is larger comes without its
--              payload and headers (it cannot become a Kafka message); one
--              whose JSON weighs more than four times this uncompressed is
--              not even made into text
--   $5 tid[]   rows an UPDATE moved since their lock (a fetch by ctid did
--   $6 uuid[]  not find them): their lock's ctid and, in the same order, their
--              outbox_id, by which they are found; each row comes with the
--              ctid of $5. Empty arrays but then (and $1 empty then).
-- Returns, in the binary format: ctid, outbox_id (a row is taken where its
-- own id is only: VACUUM FULL, CLUSTER or an UPDATE move rows, and another
-- row this relay holds may come to stand at a ctid one of its rows had; a
-- row found under another's ctid counts as not found), size (the bytes of
-- the row's text, which the two limits count), event_type, event_version, topic_name,
-- partition_key, event_key, payload (JSON text, NULL for a tombstone or a
-- row over $4), headers (headers_json's members as netstrings
-- "<len>:<name><len>:<value>", strings as they are and other JSON as its
-- text; NULL when headers_json is not an object or the row is over $4),
-- correlation_id, causation_id, trace_id, occurred_at. Rows left out by $3
-- are asked for again.
--
-- Plan: a TID scan (and a primary key probe per moved row); each row's text
-- is made once (materialized) and summed in the order the scans give.
WITH texts AS MATERIALIZED (
  SELECT o.tid, o.outbox_id, o.event_type, o.event_version, o.topic_name, o.partition_key,
         o.event_key, o.correlation_id, o.causation_id, o.trace_id, o.occurred_at,
         w.bytes > 4 * $4 AS huge,
         w.bytes AS stored,
         CASE WHEN w.bytes <= 4 * $4 THEN o.payload_json::text END AS payload,
         CASE WHEN w.bytes > 4 * $4 THEN NULL
              WHEN o.headers_json = '{}' THEN ''
              WHEN jsonb_typeof(o.headers_json) = 'object' THEN coalesce((
                SELECT string_agg(octet_length(h.key)::text || ':' || h.key
                                  || octet_length(h.v)::text || ':' || h.v, '' ORDER BY h.key)
                FROM (SELECT key, CASE WHEN jsonb_typeof(value) = 'string'
                                       THEN value #>> '{}' ELSE value::text END AS v
                      FROM jsonb_each(o.headers_json)) h), '')
         END AS headers,
         octet_length(o.tenant_id)::bigint + octet_length(o.aggregate_type)
         + octet_length(o.aggregate_id) + octet_length(o.event_type)
         + coalesce(octet_length(o.topic_name), 0) + coalesce(octet_length(o.partition_key), 0)
         + coalesce(octet_length(o.event_key), 0) + coalesce(octet_length(o.correlation_id), 0)
         + coalesce(octet_length(o.causation_id), 0) + coalesce(octet_length(o.trace_id), 0)
           AS fixed
  FROM (SELECT t.ctid AS tid, t.* FROM :table t WHERE t.ctid = ANY ($1::tid[])
        UNION ALL
        SELECT m.tid, t.* FROM unnest($5::tid[], $6::uuid[]) AS m (tid, id)
        JOIN :table t ON t.outbox_id = m.id) o
  -- what the JSON columns weigh uncompressed: a compressed value may stand
  -- for hundreds of times its stored size (126 MB of one character is
  -- stored in 1.5 MB), and making that into text takes seconds. A copy
  -- (x || '{}') is uncompressed; only compressed values over $4 / 256 are
  -- copied, the others weigh what they store.
  CROSS JOIN LATERAL (
    SELECT coalesce(CASE WHEN pg_column_compression(o.payload_json) IS NOT NULL
                              AND pg_column_size(o.payload_json) > $4 / 256
                         THEN pg_column_size(o.payload_json || '{}'::jsonb)
                         ELSE pg_column_size(o.payload_json) END, 0)::bigint
           + coalesce(CASE WHEN pg_column_compression(o.headers_json) IS NOT NULL
                                AND pg_column_size(o.headers_json) > $4 / 256
                           THEN pg_column_size(o.headers_json || '{}'::jsonb)
                           ELSE pg_column_size(o.headers_json) END, 0) AS bytes) w
  WHERE o.status = 'PUBLISHING' AND o.locked_by = $2 /* test: fetch fault */
    /* test: fetch kill */),
sized AS (
  SELECT t.*,
         t.fixed + CASE WHEN t.huge THEN t.stored
                        ELSE coalesce(octet_length(t.payload), 0)::bigint
                             + coalesce(octet_length(t.headers), 0) END AS size
  FROM texts t),
counted AS (
  SELECT s.*, coalesce(sum(s.size) OVER (ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0)
              AS before
  FROM sized s)
SELECT c.tid, c.outbox_id, c.size, c.event_type, c.event_version, c.topic_name, c.partition_key,
       c.event_key,
       CASE WHEN c.size <= $4 THEN c.payload END AS payload,
       CASE WHEN c.size <= $4 THEN c.headers END AS headers,
       c.correlation_id, c.causation_id, c.trace_id, c.occurred_at
FROM counted c
WHERE c.before < $3
