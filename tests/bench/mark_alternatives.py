#!/usr/bin/python3
"""tests/bench/mark_alternatives.py - what marking a published row costs
PostgreSQL, timed alone, for today's storage and for storing published rows
elsewhere (a design question for the 35 us per event target, issue 24):

  update    today's mark (relay/sql/mark_published.sql): the row stays, a
            non-HOT UPDATE (published_at leaves the due index), so every
            index of the outbox gets a new entry
  move      DELETE of the row, its identity (outbox_id, aggregate key and
            version) INSERTed into a narrow published table with a guard
            index and a BRIN index on published_at
  delete    the DELETE alone (the floor of any design that moves rows out)

With --indexes it times today's mark alone on tables that lack one or more of
the outbox's indexes (one schema per variant, `mark_alternatives_<variant>`,
batches taking turns across the tables): what each index adds to a mark.

    mark_alternatives.py DATABASE_URL [ROWS] [--indexes]   (default 120000)

Makes a scratch schema `mark_alternatives` (dropped after), the outbox of
schemas/postgres, ROWS events of ~500 bytes over 2000 aggregates, locks them
all PUBLISHING as the relay does (a HOT update), then marks them in batches
of 500, the three variants taking turns batch by batch on the one table, each
statement committed. Prints per variant the median, p25 and p75 of the
microseconds per row and the WAL bytes per row. Nothing else should run on
the server or the machine meanwhile."""
import glob
import os
import statistics
import sys
import time

import psycopg2

HERE = os.path.dirname(os.path.abspath(__file__))
SCHEMAS = os.path.join(HERE, "..", "..", "schemas", "postgres")
SCHEMA = "mark_alternatives"
BATCH = 500

VARIANTS = [
    ("update", """UPDATE outbox_event o
SET status = 'PUBLISHED', published_at = now(), locked_by = NULL, locked_at = NULL,
    updated_at = clock_timestamp()
FROM unnest(%s::tid[], %s::uuid[]) AS m(tid, id)
WHERE o.ctid = m.tid AND o.outbox_id = m.id AND o.status = 'PUBLISHING' AND o.locked_by = 'r1'
RETURNING o.outbox_id"""),
    ("move", """WITH d AS (
  DELETE FROM outbox_event o USING unnest(%s::tid[], %s::uuid[]) AS m(tid, id)
  WHERE o.ctid = m.tid AND o.outbox_id = m.id AND o.status = 'PUBLISHING' AND o.locked_by = 'r1'
  RETURNING o.outbox_id, hashtextextended(o.aggregate_id, hashtextextended(o.aggregate_type,
              hashtextextended(o.tenant_id, 0))) AS k,
            o.tenant_id, o.aggregate_type, o.aggregate_id, o.aggregate_version)
INSERT INTO outbox_published SELECT d.*, now() FROM d RETURNING outbox_id"""),
    ("delete", """DELETE FROM outbox_event o USING unnest(%s::tid[], %s::uuid[]) AS m(tid, id)
WHERE o.ctid = m.tid AND o.outbox_id = m.id AND o.status = 'PUBLISHING' AND o.locked_by = 'r1'
RETURNING o.outbox_id"""),
]


# the plan types the relay's session turns off
PLAN_SETTINGS = ("SET jit = off; SET enable_seqscan = off; SET enable_bitmapscan = off;"
                 " SET enable_hashjoin = off; SET enable_mergejoin = off")

# what --indexes leaves out, per variant
INDEX_VARIANTS = [
    ("all", []),
    ("no_retention", ["INDEX outbox_event_retention_idx"]),
    ("no_agg", ["INDEX outbox_event_agg_published_idx"]),
    ("no_unique", ["CONSTRAINT outbox_event_aggregate_version_key"]),
    ("pkey_only", ["INDEX outbox_event_retention_idx", "INDEX outbox_event_agg_published_idx",
                   "CONSTRAINT outbox_event_aggregate_version_key"]),
]


def make_outbox(cur):
    """The outbox of schemas/postgres in the first schema of the search path."""
    for f in sorted(glob.glob(os.path.join(SCHEMAS, "*.sql"))):
        with open(f, encoding="utf-8") as fh:
            cur.execute(fh.read())


def load_and_lock(cur, n):
    """n events over 2000 aggregates, all locked PUBLISHING by r1 (a HOT update,
    as the relay's lock); returns their (ctid, outbox_id) in insert order."""
    for start in range(0, n, 10000):
        cur.execute("INSERT INTO outbox_event (aggregate_type, aggregate_id, aggregate_version,"
                    " event_type, payload_json) SELECT 'Order', 'a' || (i %% 2000),"
                    " i / 2000 + 1, 'E', jsonb_build_object('i', i, 'pad', repeat('x', 440))"
                    " FROM generate_series(%s, %s) i", (start, min(start + 10000, n) - 1))
    cur.execute("VACUUM ANALYZE outbox_event")
    cur.execute("UPDATE outbox_event SET status = 'PUBLISHING', locked_by = 'r1',"
                " locked_at = now(), attempt_count = 1")
    cur.execute("SELECT ctid::text, outbox_id::text FROM outbox_event"
                " ORDER BY created_at, aggregate_version")
    return cur.fetchall()


def mark_batch(cur, sql, batch):
    """Runs one mark of `batch`; returns (seconds, WAL bytes)."""
    tids = "{%s}" % ",".join('"%s"' % t for t, _ in batch)
    ids = "{%s}" % ",".join(x for _, x in batch)
    cur.execute("SELECT pg_current_wal_insert_lsn()")
    lsn = cur.fetchone()[0]
    t0 = time.perf_counter()
    cur.execute(sql, (tids, ids))
    marked = len(cur.fetchall())
    took = time.perf_counter() - t0
    if marked != len(batch):
        raise SystemExit("marked %d of %d rows" % (marked, len(batch)))
    cur.execute("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s)", (lsn,))
    return took, cur.fetchone()[0]


def report(name, per_row, wal_bytes, rows):
    q = statistics.quantiles(per_row, n=4)
    print("%-12s batches %4d  us/row median %5.1f  p25 %5.1f  p75 %5.1f  WAL bytes/row %4.0f"
          % (name, len(per_row), statistics.median(per_row), q[0], q[2], wal_bytes / rows))


def by_index(cur, n):
    """Today's mark on one table per INDEX_VARIANTS entry, batches taking turns
    (the order reversed every other round)."""
    rows = {}
    try:
        for name, drops in INDEX_VARIANTS:
            schema = "%s_%s" % (SCHEMA, name)
            cur.execute("DROP SCHEMA IF EXISTS %s CASCADE; CREATE SCHEMA %s; SET search_path = %s"
                        % (schema, schema, schema))
            make_outbox(cur)
            for d in drops:
                cur.execute(("ALTER TABLE outbox_event DROP %s" if d.startswith("CONSTRAINT")
                             else "DROP %s") % d)
            rows[name] = load_and_lock(cur, n)
        cur.execute("CHECKPOINT")
        per_row = {name: [] for name, _ in INDEX_VARIANTS}
        wal = {name: 0 for name, _ in INDEX_VARIANTS}
        for i in range(0, n, BATCH):
            turn = INDEX_VARIANTS if (i // BATCH) % 2 == 0 else INDEX_VARIANTS[::-1]
            for name, _ in turn:
                cur.execute("SET search_path = %s_%s" % (SCHEMA, name))
                batch = rows[name][i:i + BATCH]
                took, w = mark_batch(cur, VARIANTS[0][1], batch)
                per_row[name].append(took * 1e6 / len(batch))
                wal[name] += w
        for name, _ in INDEX_VARIANTS:
            report(name, per_row[name], wal[name], n)
    finally:
        for name, _ in INDEX_VARIANTS:
            cur.execute("DROP SCHEMA IF EXISTS %s_%s CASCADE" % (SCHEMA, name))


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    url = args[0]
    n = int(args[1]) if len(args) > 1 else 120000
    conn = psycopg2.connect(url, options="-c search_path=%s" % SCHEMA)
    conn.autocommit = True
    cur = conn.cursor()
    cur.execute("DROP SCHEMA IF EXISTS %s CASCADE; CREATE SCHEMA %s" % (SCHEMA, SCHEMA))
    try:
        cur.execute(PLAN_SETTINGS)
        if "--indexes" in sys.argv:
            return by_index(cur, n)
        make_outbox(cur)
        cur.execute("CREATE TABLE outbox_published (outbox_id uuid NOT NULL, k bigint NOT NULL,"
                    " tenant_id text NOT NULL, aggregate_type text NOT NULL,"
                    " aggregate_id text NOT NULL, aggregate_version bigint NOT NULL,"
                    " published_at timestamptz NOT NULL)")
        cur.execute("CREATE INDEX ON outbox_published (k, aggregate_version)")
        cur.execute("CREATE INDEX ON outbox_published USING brin (published_at)")
        rows = load_and_lock(cur, n)
        per_row = {name: [] for name, _ in VARIANTS}
        wal = {name: 0 for name, _ in VARIANTS}
        done = {name: 0 for name, _ in VARIANTS}
        for i in range(0, len(rows), BATCH):
            name, sql = VARIANTS[(i // BATCH) % len(VARIANTS)]
            batch = rows[i:i + BATCH]
            took, w = mark_batch(cur, sql, batch)
            wal[name] += w
            done[name] += len(batch)
            per_row[name].append(took * 1e6 / len(batch))
        for name, _ in VARIANTS:
            report(name, per_row[name], wal[name], done[name])
    finally:
        cur.execute("DROP SCHEMA IF EXISTS %s CASCADE" % SCHEMA)
        conn.close()


if __name__ == "__main__":
    main()
