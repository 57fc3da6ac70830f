"""The daemons' statements as they stand in relay/sql, sweeper/sql and
common/sql: each one is printed, prepared and EXPLAINed on a real server
(under the relay's session settings: for the sweeper's, whose session leaves
plans to the planner, that shows a plan without a sequential scan exists).
No lock statement's plan depends on the planner's statistics: with the
statistics of an idle outbox (everything published, then a burst the planner
has not seen) a 500-row lock takes at most 1.5 times what it takes with fresh
statistics, in a 100k-row backlog (docs/DESIGN.md, "Statements"). The relay
never runs ANALYZE."""
import contextlib
import glob
import json
import os
import re
import statistics

import pytest
from harness import Postgres, TestSchema, make_events, repo_root

SQL_DIR = os.path.join(repo_root(), "relay", "sql")
SQL_DIRS = [SQL_DIR, os.path.join(repo_root(), "sweeper", "sql"),
            os.path.join(repo_root(), "common", "sql")]

# What the relay's lock and mark sessions set (common/db_async.c, send_session):
# the plan types its statements never want are off, generic plans.
SESSION = ("SET jit = off; SET plan_cache_mode = force_generic_plan;"
           " SET enable_seqscan = off; SET enable_bitmapscan = off; SET enable_sort = off;"
           " SET enable_hashjoin = off; SET enable_mergejoin = off; SET enable_material = off;")

# Test values for each statement's parameters ($1 ...), by statement name.
PARAMS = {
    "lock": ["'r1'", "500", "'{}'::bigint[]", "'{}'::bigint[]", "'aggregate'", "'{}'::bigint[]"],
    "lock_none": ["'r1'", "500"],
    "fetch": ["'{\"(0,1)\"}'::tid[]", "'r1'", "4194304", "1000000", "'{}'::tid[]",
              "'{}'::uuid[]"],
    "mark_published": ["'r1'", "'{\"(0,1)\"}'::tid[]",
                       "'{00000000-0000-0000-0000-000000000000}'::uuid[]"],
    "mark_published_by_id": ["'r1'", "'{00000000-0000-0000-0000-000000000000}'::uuid[]"],
    "mark_unpublished": ["'r1'", "'FAILED'", "'{00000000-0000-0000-0000-000000000000}'::uuid[]",
                         "'{1000}'::bigint[]", "'{X}'::text[]", "'{x}'::text[]", "'{0}'::int[]"],
    "mark_released": ["'r1'", "'{00000000-0000-0000-0000-000000000000}'::uuid[]"],
    "mark_probe": ["'r1'", "'{00000000-0000-0000-0000-000000000000}'::uuid[]"],
    "take_back_own": ["'r1'", "now()", "10", "10000"],
    "sample": [],
    "gaps": ["5", "20"],
    "held": ["'{}'::bigint[]"],
    "horizon": [],
    "blockers": ["pg_backend_pid()"],
    "unpark": ["10000", "0"],
    "reset_stale": ["300", "1000", "10"],
    "delete_published": ["86400", "1000"],
    "delete_keep_latest": ["86400", "1000"],
    "park_blocked": ["10000"],
    "indexes": ["'{due,unpublished,published,retention,old}'"],
}


def statements():
    return sorted(p for d in SQL_DIRS for p in glob.glob(os.path.join(d, "*.sql")))


def text_for(db, path):
    """The statement as the relay prepares it: the table's name in place of
    :table and :'table', the test hooks' markers left as the comments they are."""
    with open(path, encoding="utf-8") as f:
        sql = f.read()
    qtable = '"%s"."outbox_event"' % db.schema
    return sql.replace(":'table'", "'%s'" % qtable).replace(":table", qtable)


@pytest.fixture(scope="module")
def pg():
    return Postgres()


def test_every_statement_file_has_its_parameters_listed():
    names = {os.path.basename(p)[:-4] for p in statements()}
    assert len(names) == len(statements()), "two statement files of one name"
    assert names == set(PARAMS), "a statement file changed: list the new statement's parameters"


@pytest.mark.parametrize("path", statements(), ids=lambda p: os.path.basename(p)[:-4])
def test_statement_prepares_and_explains(pg, path):
    name = os.path.basename(path)[:-4]
    with TestSchema(pg, "stmt_" + name) as db:
        db.insert_events(make_events(aggregates=3, versions=3))
        sql = text_for(db, path)
        print("-- %s\n%s" % (os.path.relpath(path, repo_root()), sql))
        db.execute(SESSION)
        db.execute("PREPARE s AS " + sql)
        args = ", ".join(PARAMS[name])
        plan = db.execute("EXPLAIN EXECUTE s%s" % ("(%s)" % args if args else ""))
        text = "\n".join(r["QUERY PLAN"] for r in plan)
        print(text)
        assert "Seq Scan on outbox_event" not in text, text


def buffers(node):
    """Shared buffers a plan (JSON) touched, its own and its children's."""
    return node.get("Shared Hit Blocks", 0) + node.get("Shared Read Blocks", 0)


def test_mark_probe_reads_each_row_a_bounded_number_of_times(pg):
    """mark_probe asks about a whole mark's rows (up to 4 batches): each row is
    read by a primary key probe, a few buffers, however many rows it is
    given; a lock subquery left uncorrelated would read every row for each."""
    with TestSchema(pg, "stmt_probe") as db:
        db.insert_events(make_events(aggregates=500, versions=4))
        db.execute("UPDATE %s SET status = 'PUBLISHING', locked_by = 'r1', locked_at = now()"
                   % db.table)
        ids = [r["outbox_id"] for r in db.rows()]
        db.execute(SESSION)
        db.execute("PREPARE s AS " + text_for(db, os.path.join(repo_root(), "relay", "sql",
                                                                "mark_probe.sql")))
        per_row = []
        for n in (200, 2000):
            rows = db.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE s('r1', %s)"
                              % ("'{%s}'::uuid[]" % ",".join(ids[:n])))
            plan = rows[0]["QUERY PLAN"]
            plan = (plan if isinstance(plan, list) else json.loads(plan))[0]["Plan"]
            assert plan["Actual Rows"] == n, plan
            per_row.append(buffers(plan) / n)
        assert max(per_row) < 20, per_row


def plan_of(db, name, analyze):
    """The lock statement's plan (JSON), run in a transaction rolled back after,
    so every run sees the same table."""
    args = ", ".join(PARAMS[name])
    db.execute("BEGIN")
    try:
        rows = db.execute("EXPLAIN (%sFORMAT JSON) EXECUTE s(%s)"
                          % ("ANALYZE, BUFFERS, TIMING OFF, " if analyze else "", args))
    finally:
        db.execute("ROLLBACK")
    plan = rows[0]["QUERY PLAN"]
    return plan if isinstance(plan, list) else json.loads(plan)


def shape(node):
    """A plan's node types and indexes, depth first: what a statistic could change."""
    out = [node["Node Type"] + (":" + node["Index Name"] if "Index Name" in node else "")]
    for child in node.get("Plans", []):
        out += shape(child)
    return out


@pytest.mark.parametrize("name,old_index", [("lock", False), ("lock_none", False),
                                            ("lock", True)])
def test_lock_plans_do_not_depend_on_statistics(pg, name, old_index):
    # 100k pending rows over 2000 aggregates, written in transactions of 100 as
    # a burst would; the first 500 already published so the guard has
    # predecessors to probe. old_index: the guard index older relays probe is
    # there too, as 007_guard_split.sql leaves it until dropped by hand.
    with contextlib.ExitStack() as stack:
        dbs = {}
        for stats in ("idle", "fresh"):
            db = dbs[stats] = stack.enter_context(TestSchema(pg, "plan_%s_%s" % (name, stats)))
            # the statistics are the test's to set: no autovacuum ANALYZE
            db.execute("ALTER TABLE %s SET (autovacuum_enabled = false)" % db.table)
            if old_index:
                db.execute("CREATE INDEX outbox_event_agg_idx ON %s (hashtextextended("
                           "aggregate_id, hashtextextended(aggregate_type,"
                           " hashtextextended(tenant_id, 0))), aggregate_version,"
                           " (published_at IS NULL))" % db.table)
            if stats == "idle":
                # the statistics of an idle outbox: everything published
                db.insert_events(make_events(aggregates=2000, versions=1, id_prefix="old"))
                db.execute("UPDATE %s SET status = 'PUBLISHED', published_at = now()" % db.table)
                db.execute("VACUUM ANALYZE %s" % db.table)
                db.execute("DELETE FROM %s" % db.table)
            db.execute(
                "INSERT INTO %s (aggregate_type, aggregate_id, aggregate_version, event_type,"
                " payload_json, txid)"
                " SELECT 'Order', 'order-' || (g %% 2000), g / 2000 + 1, 'Changed',"
                " jsonb_build_object('n', g, 'note', repeat('x', 400)), NULL"
                " FROM generate_series(0, 99999) g" % db.table)
            db.execute("UPDATE %s SET status = 'PUBLISHED', published_at = now()"
                       " WHERE aggregate_version = 1" % db.table)
            if stats == "fresh":
                db.execute("VACUUM ANALYZE %s" % db.table)
            db.execute(SESSION)
            db.execute("PREPARE s AS " + text_for(db, os.path.join(SQL_DIR, name + ".sql")))
            plan_of(db, name, analyze=True)  # warm the cache
        # The two tables take turns, so that other work on the machine falls on
        # both alike; each keeps its fastest run: what the plan costs.
        times = {"idle": [], "fresh": []}
        buffers = {"idle": [], "fresh": []}
        rows = {}
        for turn in range(8):
            for stats in (("idle", "fresh") if turn % 2 else ("fresh", "idle")):
                db = dbs[stats]
                p = plan_of(db, name, analyze=True)[0]
                times[stats].append(p["Execution Time"])
                buffers[stats].append(p["Plan"].get("Shared Hit Blocks", 0)
                                      + p["Plan"].get("Shared Read Blocks", 0))
                rows[stats] = p["Plan"]["Actual Rows"]
        runs = {stats: {"shape": shape(plan_of(db, name, analyze=False)[0]["Plan"]),
                        "ms": min(times[stats]), "buffers": statistics.median(buffers[stats]),
                        "rows": rows[stats]}
                for stats, db in dbs.items()}
        (analyzed,) = dbs["idle"].execute(
            "SELECT last_autoanalyze FROM pg_stat_user_tables WHERE relid = %s::regclass",
            (dbs["idle"].table,))
        assert analyzed["last_autoanalyze"] is None, "the idle statistics were replaced"
    idle, fresh = runs["idle"], runs["fresh"]
    print("%s: idle statistics %.1f ms (%d buffers, %d rows), fresh %.1f ms (%d buffers, %d rows)"
          % (name, idle["ms"], idle["buffers"], idle["rows"], fresh["ms"], fresh["buffers"],
             fresh["rows"]))
    assert idle["rows"] == fresh["rows"] > 0
    assert idle["shape"] == fresh["shape"], (idle["shape"], fresh["shape"])
    assert not [n for n in idle["shape"] if n.endswith(":outbox_event_agg_idx")], idle["shape"]
    assert idle["buffers"] <= 1.5 * fresh["buffers"]
    assert idle["ms"] <= 1.5 * fresh["ms"] + 2.0, (idle["ms"], fresh["ms"])


def test_the_relay_never_analyzes():
    for path in statements():
        with open(path, encoding="utf-8") as f:
            assert not re.search(r"\bANALYZE\b", f.read()), path
