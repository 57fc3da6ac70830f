-- mark_probe: after a mark gave up waiting for a lock, which of its rows a
-- mark could take now. Another transaction holding one of them (a DBA's
-- UPDATE left open, an operator's script) makes every mark that includes
-- it wait; the rows it does not hold are marked without it, and the held
-- ones are asked about again until they are free (docs/DESIGN.md,
-- "Statement failures"). Never waits for a row: SKIP LOCKED.
--   $1 text     relay id
--   $2 uuid[]   the rows' outbox_ids
-- Returns each of those rows this relay still holds: outbox_id, and whether
-- no other transaction holds a lock its mark would wait for. A row missing
-- from the answer is no longer this relay's.
--
-- Plan: unnest, then per row a primary key probe and, for the lock, a
-- second one (LATERAL: the locking subquery cannot be pulled up, and
-- without the row's id in it each row would lock all of them).
SELECT o.outbox_id, f.free IS NOT NULL AS free
FROM unnest($2::uuid[]) AS m(id)
JOIN :table o ON o.outbox_id = m.id
LEFT JOIN LATERAL (SELECT TRUE AS free
                   FROM :table x
                   WHERE x.outbox_id = o.outbox_id
                     AND x.status = 'PUBLISHING' AND x.locked_by = $1
                   FOR NO KEY UPDATE OF x SKIP LOCKED) AS f ON TRUE
WHERE o.status = 'PUBLISHING' AND o.locked_by = $1
