-- lock: locks the next batch under OUTBOX_ORDERING=aggregate or increasing
-- (docs/DESIGN.md, "Status machine" steps 1 and 2, "Per-aggregate order").
--   $1 text      relay id (locked_by)
--   $2 int       rows at most
--   $3 bigint[]  keys of aggregates to leave out from a version on: those a
--   $4 bigint[]  gap holds (from the held version); in pairs
--   $5 text      the ordering: aggregate or increasing
--   $6 bigint[]  keys of aggregates to leave out whole: those this relay has
--                in flight (a run of versions, or a row a slow broker holds),
--                whose later versions the guard would hold at the window's
--                head; the row's key is computed once and compared to each
-- Returns the rows it locked: ctid after the lock, outbox_id, attempt_count,
-- late_after (a published version above the row: the row goes DEAD
-- unsent), the aggregate and version, size (what the row weighs as stored:
-- the fetch measures its text), the aggregate's key; and the rows it moved
-- back or parked (deferred true, see below; parked true for the latter),
-- which the relay does not hold.
--
-- Plan: one index scan of outbox_event_due_idx (the window), a TID probe per
-- row (visible), one sort of the window by aggregate, then per aggregate
-- (on its head row only) one descent of outbox_event_agg_published_idx and
-- at most two of outbox_event_agg_unpublished_idx (and a second of the
-- published one when two event types share the lowest version), then the
-- update by ctid. The session turns off the plan types this statement never
-- wants (sequential and bitmap scans, sorts an index can replace, hash and
-- merge joins), so no statistics can change its shape.
--
-- An aggregate's key is a 64-bit hash of (tenant_id, aggregate_type,
-- aggregate_id): the probes compare integers. Every probe also checks the
-- three columns themselves, so two aggregates with the same key never
-- decide for each other.
WITH horizon AS MATERIALIZED (
  -- every transaction older than this has ended
  SELECT pg_snapshot_xmin(pg_current_snapshot()) AS xmin),
window_rows AS MATERIALIZED (
  -- the oldest due rows, lower versions first among rows due at once; under
  -- increasing only rows every older transaction of which has ended (a
  -- version still being written below them would be in sight)
  SELECT o.ctid AS tid, o.tenant_id, o.aggregate_type, o.aggregate_id,
         o.aggregate_version AS v, o.txid, o.available_at AS due,
         hashtextextended(o.aggregate_id, hashtextextended(o.aggregate_type,
           hashtextextended(o.tenant_id, 0))) AS k
  FROM :table o
  WHERE o.published_at IS NULL AND o.status IN ('PENDING', 'FAILED')
    AND o.available_at <= now() /* test: lock pause */
    AND ($5 = 'aggregate' OR o.txid IS NULL OR o.txid < (SELECT xmin FROM horizon))
    AND hashtextextended(o.aggregate_id, hashtextextended(o.aggregate_type,
          hashtextextended(o.tenant_id, 0))) <> ALL ($6::bigint[])
    AND NOT EXISTS (
      SELECT 1 FROM unnest($3::bigint[], $4::bigint[]) AS x(k, from_v)
      WHERE x.k = hashtextextended(o.aggregate_id, hashtextextended(o.aggregate_type,
                    hashtextextended(o.tenant_id, 0)))
        AND o.aggregate_version >= x.from_v)
  ORDER BY o.available_at, o.aggregate_version
  LIMIT $2
  FOR UPDATE OF o SKIP LOCKED),
visible AS MATERIALIZED (
  -- FOR UPDATE locks, and returns, the newest version of a row another
  -- transaction changed after the statement began; the statement cannot
  -- update that version (its snapshot does not see it), so the row sits this
  -- batch out, and to the guard it is a version the window lacks
  SELECT w.* FROM window_rows w
  WHERE EXISTS (SELECT 1 FROM :table c WHERE c.ctid = w.tid)),
aggregates AS (
  -- each row with its aggregate's lowest and highest version in the window;
  -- `head` marks one row per aggregate, the one that probes
  SELECT w.*, min(w.v) OVER a AS lo, max(w.v) OVER a AS hi, count(*) OVER a AS n,
         min(w.due) OVER a AS min_due,
         w.tid = min(w.tid) OVER a AS head
  FROM visible w
  WINDOW a AS (PARTITION BY w.k, w.tenant_id, w.aggregate_type, w.aggregate_id)),
probed AS (
  SELECT r.*, pub.v AS pub_v,
         CASE WHEN up.v IS NOT NULL THEN up.v ELSE below.v END AS prev_v,
         CASE WHEN up.v IS NOT NULL THEN false
              WHEN below.v IS NOT NULL THEN true END AS prev_published,
         up.due AS prev_due, up.status AS prev_status, inside.n AS n_unpublished
  FROM aggregates r
  -- the aggregate's highest published version (one descent of the published
  -- index). Whatever the state of the versions between it and the window
  -- (a lower one another transaction holds locked, in flight to DEAD, or not
  -- yet visible to this statement's snapshot), a window row below it is late
  LEFT JOIN LATERAL (
    SELECT p.aggregate_version AS v
    FROM :table p
    WHERE r.head AND p.published_at IS NOT NULL
      AND hashtextextended(p.aggregate_id, hashtextextended(p.aggregate_type,
            hashtextextended(p.tenant_id, 0))) = r.k
      AND p.tenant_id = r.tenant_id COLLATE "C"
      AND p.aggregate_type = r.aggregate_type COLLATE "C"
      AND p.aggregate_id = r.aggregate_id COLLATE "C"
    ORDER BY hashtextextended(p.aggregate_id, hashtextextended(p.aggregate_type,
               hashtextextended(p.tenant_id, 0))) DESC,
             p.aggregate_version DESC
    LIMIT 1) pub ON true
  -- the highest published version below the window's lowest: that one, or,
  -- when it equals the lowest (two event types of one version), the next
  -- published version below it
  LEFT JOIN LATERAL (
    SELECT pub.v AS v WHERE pub.v < r.lo
    UNION ALL
    (SELECT p.aggregate_version
     FROM :table p
     WHERE r.head AND pub.v = r.lo AND p.published_at IS NOT NULL
       AND hashtextextended(p.aggregate_id, hashtextextended(p.aggregate_type,
             hashtextextended(p.tenant_id, 0))) = r.k
       AND p.aggregate_version < r.lo
       AND p.tenant_id = r.tenant_id COLLATE "C"
       AND p.aggregate_type = r.aggregate_type COLLATE "C"
       AND p.aggregate_id = r.aggregate_id COLLATE "C"
     ORDER BY hashtextextended(p.aggregate_id, hashtextextended(p.aggregate_type,
                hashtextextended(p.tenant_id, 0))) DESC,
              p.aggregate_version DESC
     LIMIT 1)) below ON true
  -- the highest unpublished version below the window's lowest and not below
  -- that published one (an unpublished row of the same version comes first):
  -- the previous version, when there is one. A LATE_VERSION row, DEAD or
  -- locked to go DEAD (see the update), is not in the order (a later version
  -- reached Kafka before it committed): the versions above it follow the
  -- version below it, or count as the aggregate's first. Not probed when a
  -- published version above the lowest makes rows late (see chosen)
  LEFT JOIN LATERAL (
    SELECT p.aggregate_version AS v, p.available_at AS due, p.status
    FROM :table p
    WHERE r.head AND (pub.v IS NULL OR pub.v <= r.lo) AND p.published_at IS NULL
      AND hashtextextended(p.aggregate_id, hashtextextended(p.aggregate_type,
            hashtextextended(p.tenant_id, 0))) = r.k
      AND p.aggregate_version < r.lo
      AND p.aggregate_version >= coalesce(below.v, -9223372036854775808)
      AND (p.status NOT IN ('DEAD', 'PUBLISHING')
           OR p.last_error_code IS DISTINCT FROM 'LATE_VERSION')
      AND p.tenant_id = r.tenant_id COLLATE "C"
      AND p.aggregate_type = r.aggregate_type COLLATE "C"
      AND p.aggregate_id = r.aggregate_id COLLATE "C"
    ORDER BY hashtextextended(p.aggregate_id, hashtextextended(p.aggregate_type,
               hashtextextended(p.tenant_id, 0))) DESC,
             p.aggregate_version DESC
    LIMIT 1) up ON true
  -- with several rows in the window: the unpublished rows between its lowest
  -- and highest version, to tell whether the window holds them all (the
  -- window's own rows are among them: counting one more than it holds
  -- answers; in index order, so that no statistics make another index look
  -- cheaper)
  LEFT JOIN LATERAL (
    SELECT count(*) AS n
    FROM (SELECT 1
          FROM :table p
          WHERE r.head AND r.n > 1 AND (pub.v IS NULL OR pub.v <= r.lo)
            AND p.published_at IS NULL
            AND hashtextextended(p.aggregate_id, hashtextextended(p.aggregate_type,
                  hashtextextended(p.tenant_id, 0))) = r.k
            AND p.aggregate_version >= r.lo AND p.aggregate_version <= r.hi
            AND p.tenant_id = r.tenant_id COLLATE "C"
            AND p.aggregate_type = r.aggregate_type COLLATE "C"
            AND p.aggregate_id = r.aggregate_id COLLATE "C"
          ORDER BY hashtextextended(p.aggregate_id, hashtextextended(p.aggregate_type,
                     hashtextextended(p.tenant_id, 0))),
                   p.aggregate_version
          LIMIT r.n + 1) u) inside ON true),
decided AS (
  -- what the head's probes say, for every row of the aggregate:
  --   next_late   a version above the window is published already
  --   published_v a version inside the window's range is published already
  --   go          aggregate: the lowest version follows the aggregate's
  --               previous one (published, one below), or there is none and
  --               it is version 1 or every older transaction has ended;
  --               increasing: the previous version is published or there is
  --               none (versions only increase: gaps are normal)
  --   all_in      the window holds every unpublished row of its range
  --   defer_to    the previous version is unpublished, not in flight and due
  --               after the lowest one here (a retry's backoff, or a row made
  --               due again by a replay, a requeue or the sweeper): the
  --               aggregate's rows move to its due time, behind it, so they
  --               do not fill the window while it waits, and the window,
  --               ordered by due time, reaches it
  --   behind_dead the previous version is DEAD (the probe skips late versions) or
  --               parked behind one: nothing of the aggregate can go before
  --               an operator acts, so its rows are parked as the sweeper
  --               parks them (docs/DESIGN.md, "The sweeper"), out of the
  --               window, which they would otherwise fill, however many
  --               they are
  SELECT d.tid, d.v, d.lo, d.k,
         max(d.pub_v) FILTER (WHERE d.head AND d.pub_v > d.hi) OVER a AS next_late,
         max(d.pub_v) FILTER (WHERE d.head AND d.pub_v > d.lo AND d.pub_v <= d.hi)
           OVER a AS published_v,
         bool_or(d.head AND CASE WHEN $5 = 'aggregate' THEN
           (d.prev_v IS NULL
            AND (d.lo = 1 OR d.txid IS NULL OR d.txid < (SELECT xmin FROM horizon)))
           OR (d.prev_published AND d.prev_v + 1 = d.lo)
           ELSE d.prev_v IS NULL OR d.prev_published END) OVER a AS go,
         bool_and(NOT d.head OR d.n = 1 OR d.n_unpublished = d.n) OVER a AS all_in,
         max(d.prev_due) FILTER (WHERE d.head AND NOT d.prev_published
                                 AND d.prev_status <> 'PUBLISHING'
                                 AND d.prev_due > d.min_due AND d.prev_due < 'infinity')
           OVER a AS defer_to,
         bool_or(d.head AND d.prev_published IS FALSE AND d.prev_due = 'infinity')
           OVER a AS behind_dead
  FROM probed d
  WINDOW a AS (PARTITION BY d.k, d.tenant_id, d.aggregate_type, d.aggregate_id)),
chosen AS (
  -- Late rows (below a published version) are locked to go DEAD unsent, and
  -- with a published version inside the range the aggregate's other rows
  -- wait for the next lock (the late ones out of the way, the guard decides
  -- on them as usual); otherwise an aggregate's rows go when its lowest
  -- version may, all of them when the window holds its whole range, else the
  -- lowest version's only (the relay sends a run's versions one after the
  -- other, each once the one before it was acknowledged, and gives back what
  -- follows a hole in the run); or they are deferred, or parked
  SELECT c.tid, c.k,
         CASE WHEN c.v < c.published_v THEN c.published_v ELSE c.next_late END AS late_after,
         c.next_late IS NULL AND c.published_v IS NULL AND NOT c.go
           AND (c.defer_to IS NOT NULL OR c.behind_dead) AS deferred,
         c.next_late IS NULL AND c.published_v IS NULL AND NOT c.go AND c.behind_dead AS parked,
         c.defer_to
  FROM decided c
  WHERE c.next_late IS NOT NULL OR c.v < c.published_v
     OR (c.published_v IS NULL
         AND ((c.go AND (c.all_in OR c.v = c.lo)) OR c.defer_to IS NOT NULL OR c.behind_dead)))
UPDATE :table o
SET status = CASE WHEN c.deferred THEN o.status ELSE 'PUBLISHING' END,
    locked_by = CASE WHEN c.deferred THEN o.locked_by ELSE $1 END,
    locked_at = CASE WHEN c.deferred THEN o.locked_at ELSE now() END,
    last_attempt_at = CASE WHEN c.deferred THEN o.last_attempt_at ELSE now() END,
    available_at = CASE WHEN c.parked THEN 'infinity'::timestamptz
                        WHEN c.deferred THEN greatest(o.available_at, c.defer_to)
                        ELSE o.available_at END,
    -- a late row carries its code from its lock on, so that other lock
    -- statements' probes for a previous version skip it while it is in
    -- flight to DEAD (the versions above it follow the published one). A
    -- row locked to be sent loses the code a requeue left on it (it is no
    -- longer late).
    last_error_code = CASE WHEN c.parked THEN 'BLOCKED'
                           WHEN c.deferred THEN o.last_error_code
                           WHEN c.late_after IS NOT NULL THEN 'LATE_VERSION'
                           WHEN o.last_error_code = 'LATE_VERSION' THEN NULL
                           ELSE o.last_error_code END,
    last_error_message = CASE WHEN c.parked
      THEN 'parked behind a DEAD version of its aggregate (due again when that is requeued, '
           'published or deleted)'
      WHEN c.deferred THEN o.last_error_message
      WHEN c.late_after IS NOT NULL
      THEN 'version ' || o.aggregate_version || ' committed after version ' || c.late_after
           || ' was published: locked to go DEAD unsent'
      WHEN o.last_error_code = 'LATE_VERSION' THEN NULL
      ELSE o.last_error_message END,
    attempt_count = CASE WHEN c.deferred OR o.attempt_count = 2147483647 THEN o.attempt_count
                         ELSE o.attempt_count + 1 END,
    updated_at = clock_timestamp()
FROM chosen c
WHERE o.ctid = c.tid
RETURNING o.ctid, o.outbox_id, o.attempt_count, c.late_after,
  o.tenant_id, o.aggregate_type, o.aggregate_id, o.aggregate_version,
  coalesce(pg_column_size(o.payload_json), 0)::bigint + pg_column_size(o.headers_json)
  + octet_length(o.tenant_id)::bigint + octet_length(o.aggregate_type)
  + octet_length(o.aggregate_id) + octet_length(o.event_type)
  + coalesce(octet_length(o.topic_name), 0)::bigint + coalesce(octet_length(o.partition_key), 0)
  + coalesce(octet_length(o.event_key), 0)::bigint + coalesce(octet_length(o.correlation_id), 0)
  + coalesce(octet_length(o.causation_id), 0)::bigint + coalesce(octet_length(o.trace_id), 0)
  AS size, c.k, c.deferred, c.parked
