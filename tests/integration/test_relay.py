"""Integration tests of outbox-relay against a real PostgreSQL server and the
local Kafka-protocol broker; every check reads the topic back."""
import glob
import json
import os
import re
import signal
import threading

import psycopg2
import psycopg2.errors
import pytest

import harness
from conftest import relay_env
from harness import Relay, check_order, count_duplicates, free_port, header, make_events, \
    read_topics, wait_until
from observe import log_records, scrape

FIXED_HEADERS = ["event-id", "event-type", "event-version", "tenant-id", "aggregate-type",
                 "aggregate-id", "aggregate-version", "occurred-at", "producer", "content-type"]
ENVELOPE_KEYS = {"event_id", "event_type", "event_version", "tenant_id", "aggregate_type",
                 "aggregate_id", "aggregate_version", "occurred_at", "correlation_id",
                 "causation_id", "trace_id", "payload"}


def published(db, n):
    return lambda: db.status_counts()["PUBLISHED"] == n


def test_end_to_end_headers_envelope_order(db, kafka, tmp_path):
    rows = make_events(aggregates=20, versions=5, aggregate_type="Order")
    for r in rows[:10]:
        r.update(correlation_id="corr-%s" % r["aggregate_id"], causation_id="cause",
                 trace_id="trace", event_key="key-%s-%d" % (r["aggregate_id"],
                                                            r["aggregate_version"]))
    ids = db.insert_events(rows)
    with Relay("outbox-relay", env=relay_env(db, kafka, OUTBOX_PRODUCER_NAME="svc-a"),
               log_dir=tmp_path) as relay:
        wait_until(published(db, len(rows)), 60, what="all rows PUBLISHED")
        assert relay.stop() == 0

    table = db.rows()
    assert all(r["status"] == "PUBLISHED" and r["attempt_count"] == 1 for r in table)
    assert all(r["locked_by"] is None and r["published_at"] for r in table)

    msgs = read_topics(kafka.bootstrap, topics=["%s.Order" % db.schema])
    assert len(msgs) == len(rows)
    assert count_duplicates(msgs) == 0
    assert sorted(header(m, "event-id") for m in msgs) == sorted(ids)
    ok, details = check_order(msgs)
    assert ok, details

    by_id = {r["outbox_id"]: r for r in table}
    for m in msgs:
        names = [h[0] for h in m["headers"]]
        for h in FIXED_HEADERS:
            assert h in names, (h, names)
        row = by_id[header(m, "event-id")]
        assert m["key"] == row["aggregate_id"]
        assert header(m, "producer") == "svc-a"
        assert header(m, "content-type") == "application/json"
        assert header(m, "aggregate-version") == str(row["aggregate_version"])
        assert header(m, "event-version") == "1"
        assert header(m, "tenant-id") == "default"
        assert header(m, "occurred-at").endswith("Z") and "T" in header(m, "occurred-at")
        env = json.loads(m["value"])
        assert set(env) == ENVELOPE_KEYS
        assert env["event_id"] == row["outbox_id"]
        assert env["aggregate_version"] == row["aggregate_version"]
        assert env["payload"] == row["payload_json"]
        assert env["occurred_at"] == header(m, "occurred-at")
        for col, hname in (("correlation_id", "correlation-id"), ("causation_id", "causation-id"),
                           ("trace_id", "trace-id"), ("event_key", "event-key")):
            assert header(m, hname) == row[col]
            if col != "event_key":
                assert env[col] == row[col]
        # A partition's messages of one aggregate come in version order.
    per_agg = {}
    for m in sorted(msgs, key=lambda m: (m["partition"], m["offset"])):
        per_agg.setdefault(m["key"], []).append(int(header(m, "aggregate-version")))
    assert all(v == sorted(v) == list(range(1, 6)) for v in per_agg.values()), per_agg


def test_topic_routing_partition_key_headers_json_tombstone(db, kafka, tmp_path):
    rows = [
        {"aggregate_type": "Order", "aggregate_id": "o1", "aggregate_version": 1,
         "event_type": "OrderCreated", "payload_json": {"n": 1}},
        {"aggregate_type": "Invoice", "aggregate_id": "i1", "aggregate_version": 1,
         "event_type": "InvoiceSent", "payload_json": {"n": 2}, "partition_key": "pk-1",
         "tenant_id": "acme"},
        {"aggregate_type": "Order", "aggregate_id": "o2", "aggregate_version": 1,
         "event_type": "OrderDeleted", "payload_json": None,
         "topic_name": "%s.explicit" % db.schema},
        {"aggregate_type": "Order", "aggregate_id": "o3", "aggregate_version": 1,
         "event_type": "OrderTagged", "payload_json": {"n": 3},
         "headers_json": {"x-str": "plain", "x-num": 42, "x-obj": {"a": [1, 2]},
                          "event-id": "forged", "producer": "forged"}},
    ]
    ids = db.insert_events(rows)
    env = relay_env(db, kafka,
                    OUTBOX_TOPIC_TEMPLATE="%s.{tenant_id}.{aggregate_type}.{event_type}" % db.schema)
    with Relay("outbox-relay", env=env, log_dir=tmp_path) as relay:
        wait_until(published(db, len(rows)), 60, what="all rows PUBLISHED")
        assert relay.stop() == 0

    msgs = read_topics(kafka.bootstrap, pattern="^%s\\." % db.schema)
    by_id = {header(m, "event-id"): m for m in msgs}
    assert len(msgs) == 4 and set(by_id) == set(ids)
    s = db.schema
    assert by_id[ids[0]]["topic"] == "%s.default.Order.OrderCreated" % s
    assert by_id[ids[1]]["topic"] == "%s.acme.Invoice.InvoiceSent" % s
    assert by_id[ids[1]]["key"] == "pk-1"
    assert header(by_id[ids[1]], "tenant-id") == "acme"
    tomb = by_id[ids[2]]
    assert tomb["topic"] == "%s.explicit" % s
    assert tomb["value"] is None and "value_b64" not in tomb
    assert header(tomb, "event-type") == "OrderDeleted"
    m = by_id[ids[3]]
    assert header(m, "x-str") == "plain"
    assert header(m, "x-num") == "42"
    assert json.loads(header(m, "x-obj")) == {"a": [1, 2]}
    assert [h[1] for h in m["headers"] if h[0] == "event-id"] == [ids[3]]
    assert [h[1] for h in m["headers"] if h[0] == "producer"] == ["outbox-relay"]


def test_value_format_payload(db, kafka, tmp_path):
    ids = db.insert_events([{"aggregate_type": "Order", "aggregate_id": "o1",
                             "aggregate_version": 1, "event_type": "E",
                             "payload_json": {"hello": "world"}}])
    with Relay("outbox-relay", env=relay_env(db, kafka, OUTBOX_VALUE_FORMAT="payload"),
               log_dir=tmp_path) as relay:
        wait_until(published(db, 1), 30, what="row PUBLISHED")
        assert relay.stop() == 0
    (m,) = read_topics(kafka.bootstrap, topics=["%s.Order" % db.schema])
    assert json.loads(m["value"]) == {"hello": "world"}
    assert header(m, "event-id") == ids[0]


def test_too_large_goes_dead_and_blocks_only_its_aggregate(db, kafka, tmp_path):
    big = "x" * 1_100_000  # over librdkafka's default message.max.bytes (1000000)
    rows = [{"aggregate_type": "Order", "aggregate_id": "poison", "aggregate_version": 1,
             "event_type": "E", "payload_json": {"pad": big}}]
    rows += [{"aggregate_type": "Order", "aggregate_id": "poison", "aggregate_version": v,
              "event_type": "E", "payload_json": {"v": v}} for v in (2, 3)]
    rows += make_events(aggregates=5, versions=3, id_prefix="ok")
    db.insert_events(rows)
    with Relay("outbox-relay", env=relay_env(db, kafka), log_dir=tmp_path) as relay:
        wait_until(published(db, 15), 60, what="the healthy aggregates PUBLISHED")
        wait_until(lambda: db.status_counts()["DEAD"] == 1, 30, what="poison row DEAD")
        # the guard keeps the poison aggregate's later versions back: they stay PENDING
        # through several more polls
        relay.wait_log(r"event dead", 10)
        assert relay.stop() == 0
        log = relay.log_text()
    dead = db.rows(where="status = 'DEAD'")
    assert len(dead) == 1 and dead[0]["aggregate_version"] == 1
    assert dead[0]["last_error_code"] == "MSG_SIZE_TOO_LARGE"
    assert dead[0]["last_error_message"]
    # parked out of every lock scan's range until an operator requeues it
    assert db.count("status = 'DEAD' AND available_at = 'infinity'") == 1
    later = db.rows(where="aggregate_id = 'poison' AND aggregate_version > 1")
    assert [r["status"] for r in later] == ["PENDING", "PENDING"]
    assert all(r["attempt_count"] == 0 for r in later)
    msgs = read_topics(kafka.bootstrap, topics=["%s.Order" % db.schema])
    assert len(msgs) == 15
    assert not any(m["key"] == "poison" for m in msgs)
    assert big[:100] not in log  # no payloads in logs


def test_lock_is_a_hot_update_and_the_table_keeps_its_invariants(db, kafka, tmp_path):
    # No index mentions a column the lock statement changes, so locking a row
    # into PUBLISHING writes no index entry (a HOT update) when its page has
    # room; only the mark to PUBLISHED does. PostgreSQL counts both.
    rows = make_events(aggregates=40, versions=5)
    db.insert_events(rows)

    def updates():
        r = db.execute("SELECT n_tup_upd AS upd, n_tup_hot_upd AS hot FROM pg_stat_user_tables"
                       " WHERE relid = %s::regclass", (db.table,))[0]
        return r["upd"], r["hot"]

    upd0, hot0 = updates()
    with Relay("outbox-relay", env=relay_env(db, kafka), log_dir=tmp_path) as relay:
        wait_until(published(db, len(rows)), 60, what="all rows PUBLISHED")
        assert relay.stop() == 0
    # a backend reports its counters at the latest when it exits
    upd, hot = wait_until(lambda: (lambda u: u if u[0] - upd0 >= 2 * len(rows) else None)(
        updates()), 20, what="the relay's updates in pg_stat_user_tables")
    assert upd - upd0 == 2 * len(rows)  # one lock and one mark per row, nothing else
    # Most locks are HOT: with fillfactor 50 a page keeps room for about one
    # new version per row, and a locked version is some 30 bytes longer
    # (locked_by, locked_at, last_attempt_at), so on pages of rows as small as
    # these the last locks of a page may not fit (85 % measured). Without the
    # design none would be HOT.
    assert hot - hot0 >= len(rows) * 0.8, (upd - upd0, hot - hot0)

    # published_at and status agree: the partial indexes rely on it
    (one,) = db.rows(where="aggregate_version = 1 AND aggregate_id = %s",
                     params=(rows[0]["aggregate_id"],))
    with pytest.raises(psycopg2.errors.CheckViolation, match="outbox_event_published_at_check"):
        db.execute("UPDATE %s SET published_at = NULL WHERE outbox_id = %%s" % db.table,
                   (one["outbox_id"],))
    # a DEAD row is parked at 'infinity': a requeue that forgets available_at
    # fails loudly instead of leaving a PENDING row that is never due
    db.execute("UPDATE %s SET status = 'DEAD', published_at = NULL,"
               " available_at = 'infinity' WHERE outbox_id = %%s" % db.table, (one["outbox_id"],))
    with pytest.raises(psycopg2.errors.CheckViolation, match="outbox_event_parked_check"):
        db.execute("UPDATE %s SET status = 'PENDING' WHERE outbox_id = %%s" % db.table,
                   (one["outbox_id"],))


def test_upgrade_migration_from_status_indexes(db):
    # A table as the earlier 001 left it: partial indexes selecting by status,
    # an index on locked_at, no CHECKs, fillfactor 100, an unparked DEAD row
    # and a PUBLISHED row without published_at. 002 must bring it to the
    # current 001, keep every row, and be a no-op the second time.
    t = db.table
    db.execute("ALTER TABLE %s DROP CONSTRAINT outbox_event_published_at_check,"
               " DROP CONSTRAINT outbox_event_parked_check, RESET (fillfactor)" % t)
    db.execute("DROP INDEX %s.outbox_event_due_idx, %s.outbox_event_agg_unpublished_idx,"
               " %s.outbox_event_agg_published_idx, %s.outbox_event_retention_idx"
               % (db.schema, db.schema, db.schema, db.schema))
    db.execute("ALTER TABLE %s DROP CONSTRAINT outbox_event_aggregate_version_key,"
               " ADD CONSTRAINT outbox_event_aggregate_version_key UNIQUE (tenant_id,"
               " aggregate_type, aggregate_id, aggregate_version, event_type)" % t)
    db.execute("ALTER TABLE %s DROP COLUMN txid" % t)
    db.execute("CREATE INDEX outbox_event_due_idx ON %s (available_at, aggregate_version)"
               " WHERE status IN ('PENDING', 'FAILED')" % t)
    db.execute("CREATE INDEX outbox_event_unpublished_idx ON %s (tenant_id, aggregate_type,"
               " aggregate_id, aggregate_version) WHERE status <> 'PUBLISHED'" % t)
    db.execute("CREATE INDEX outbox_event_publishing_idx ON %s (locked_at)"
               " WHERE status = 'PUBLISHING'" % t)
    db.execute("CREATE INDEX outbox_event_published_idx ON %s (published_at)"
               " WHERE status = 'PUBLISHED'" % t)
    ids = db.insert_events([
        {"aggregate_type": "A", "aggregate_id": "a", "aggregate_version": v, "event_type": "E",
         "payload_json": {}, "status": st} for v, st in ((1, "PUBLISHED"), (2, "DEAD"),
                                                        (3, "PENDING"))])
    migrations = [os.path.join(harness.repo_root(), "schemas", "postgres", name)
                  for name in ("002_hot_lock_upgrade.sql", "004_version_order.sql",
                               "006_guard_index.sql", "007_guard_split.sql")]

    def apply():
        for migration in migrations:
            with open(migration, encoding="utf-8") as f:
                db.execute(f.read())
        return db.execute("SELECT c.relname AS name, pg_get_expr(i.indpred, i.indrelid) AS pred,"
                          " i.indexrelid::int AS oid FROM pg_index i JOIN pg_class c"
                          " ON c.oid = i.indexrelid WHERE i.indrelid = %s::regclass"
                          " ORDER BY 1", (t,))

    first = apply()
    assert {r["name"]: r["pred"] for r in first} == {
        "outbox_event_aggregate_version_key": None, "outbox_event_pkey": None,
        "outbox_event_due_idx": "(published_at IS NULL)",
        "outbox_event_agg_unpublished_idx": "(published_at IS NULL)",
        "outbox_event_agg_published_idx": "(published_at IS NOT NULL)",
        "outbox_event_retention_idx":
            "((published_at IS NOT NULL) AND (available_at <> 'infinity'::timestamp with time zone))"}
    assert apply() == first  # nothing rebuilt the second time
    # a table 006 gave the earlier guard index keeps it, for the relays that
    # probe it, and nothing else changes
    db.execute("CREATE INDEX outbox_event_agg_idx ON %s (hashtextextended(aggregate_id,"
               " hashtextextended(aggregate_type, hashtextextended(tenant_id, 0))),"
               " aggregate_version, (published_at IS NULL))" % t)
    assert [r["name"] for r in apply() if r not in first] == ["outbox_event_agg_idx"]
    key = db.execute("SELECT pg_get_constraintdef(oid) AS def FROM pg_constraint"
                     " WHERE conrelid = %s::regclass AND conname ="
                     " 'outbox_event_aggregate_version_key'", (t,))
    assert key == [{"def": "UNIQUE (aggregate_id, aggregate_version, aggregate_type, tenant_id,"
                           " event_type)"}]
    checks = db.execute("SELECT conname FROM pg_constraint WHERE conrelid = %s::regclass"
                        " AND contype = 'c' ORDER BY 1", (t,))
    assert [r["conname"] for r in checks] == ["outbox_event_parked_check",
                                              "outbox_event_published_at_check",
                                              "outbox_event_status_check"]
    assert db.execute("SELECT reloptions FROM pg_class WHERE oid = %s::regclass",
                      (t,))[0]["reloptions"] == ["fillfactor=50"]
    txid = db.execute("SELECT pg_get_expr(d.adbin, d.adrelid) AS def FROM pg_attrdef d"
                      " JOIN pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum"
                      " WHERE d.adrelid = %s::regclass AND a.attname = 'txid'", (t,))
    assert txid == [{"def": "pg_current_xact_id()"}]  # old rows keep NULL: "old"
    rows = {r["aggregate_version"]: r for r in db.rows()}
    assert [rows[v]["outbox_id"] for v in (1, 2, 3)] == ids
    assert all(r["txid"] is None for r in rows.values())
    assert rows[1]["published_at"] is not None  # from updated_at
    assert rows[2]["available_at"].year == 9999  # DEAD parked at 'infinity'
    assert rows[3]["status"] == "PENDING" and rows[3]["available_at"].year < 9999

    # 003 widens the parked check (BLOCKED versions may wait at 'infinity'),
    # once: the second run keeps the constraint it made.
    def parked_check():
        return db.execute("SELECT oid::int AS oid, pg_get_constraintdef(oid) AS def"
                          " FROM pg_constraint WHERE conrelid = %s::regclass"
                          " AND conname = 'outbox_event_parked_check'", (t,))

    assert "BLOCKED" not in parked_check()[0]["def"]
    upgrade = os.path.join(harness.repo_root(), "schemas", "postgres", "003_park_blocked.sql")
    for _ in range(2):
        with open(upgrade, encoding="utf-8") as f:
            db.execute(f.read())
        (check,) = parked_check()
        assert "BLOCKED" in check["def"], check
        first_oid = first_oid if _ else check["oid"]
        assert check["oid"] == first_oid
    db.execute("UPDATE %s SET available_at = 'infinity', last_error_code = 'BLOCKED'"
               " WHERE outbox_id = %%s" % t, (ids[2],))
    with pytest.raises(psycopg2.errors.CheckViolation, match="outbox_event_parked_check"):
        db.execute("UPDATE %s SET last_error_code = NULL WHERE outbox_id = %%s" % t, (ids[2],))


def test_relay_names_missing_invalid_and_old_guard_indexes(db, kafka, tmp_path):
    def checked(port):
        # the index check comes before the first table sample on the side
        # connection: once the sample's gauges are out, the check is done
        return lambda: scrape(port).value("outbox_events", status="PENDING") is not None

    def findings(relay):
        return sorted((r["level"], r["msg"].split(":")[0].split(" (")[0].split(",")[0],
                       r["index"], r.get("file"))
                      for r in log_records(relay.log_text()) if "index" in r)

    hashed = ("hashtextextended(aggregate_id, hashtextextended(aggregate_type,"
              " hashtextextended(tenant_id, 0)))")
    # the guard index of relays before 007, which 007 keeps; the unpublished
    # guard index under a name of the operator's: known by its definition
    db.execute("CREATE INDEX outbox_event_agg_idx ON %s (%s, aggregate_version,"
               " (published_at IS NULL))" % (db.table, hashed))
    db.execute("ALTER INDEX %s.outbox_event_agg_unpublished_idx RENAME TO my_unpublished"
               % db.schema)
    db.insert_events(make_events(aggregates=5, versions=4))
    port = free_port()
    env = relay_env(db, kafka, OUTBOX_HTTP_ADDR="127.0.0.1:%d" % port)
    with Relay("outbox-relay", env=env, log_dir=tmp_path / "clean") as relay:
        wait_until(checked(port), 20, what="the first table sample")
        wait_until(published(db, 20), 30, what="rows published")
        assert relay.stop() == 0
        assert not [r for r in log_records(relay.log_text()) if r.get("statement") == "indexes"]
        # each finding once: the check runs once a process
        assert findings(relay) == [
            ("info", "old guard index on the table", "outbox_event_agg_idx", None)]

    # what an operator can leave: a guard index never built, one whose
    # CREATE INDEX CONCURRENTLY failed (invalid); the old guard index then
    # stands in for the missing one
    db.execute("DROP INDEX %s.outbox_event_agg_published_idx" % db.schema)
    db.execute("DROP INDEX %s.outbox_event_due_idx" % db.schema)
    # inserted together: the aggregates' versions share their available_at
    db.insert_events(make_events(aggregates=5, versions=2, id_prefix="n"))
    with pytest.raises(psycopg2.errors.UniqueViolation):
        db.execute("CREATE UNIQUE INDEX CONCURRENTLY outbox_event_due_idx ON %s"
                   " (available_at, aggregate_version) WHERE published_at IS NULL" % db.table)
    with Relay("outbox-relay", env=env, log_dir=tmp_path / "left") as relay:
        wait_until(checked(port), 20, what="the first table sample")
        wait_until(published(db, 30), 30, what="rows published without the indexes")
        assert relay.stop() == 0
        assert findings(relay) == [
            ("warn", "index invalid", "outbox_event_due_idx",
             "schemas/postgres/001_outbox_event.sql"),
            ("warn", "index missing", "outbox_event_agg_published_idx",
             "schemas/postgres/007_guard_split.sql"),
            ("warn", "old guard index on the table", "outbox_event_agg_idx",
             "schemas/postgres/007_guard_split.sql")]

    # a guard index built by hand in descending order, and the build the
    # upgrade notes advise under way: CREATE INDEX CONCURRENTLY waiting for a
    # transaction that holds the table
    db.execute("CREATE INDEX outbox_event_agg_published_idx ON %s (%s, aggregate_version DESC)"
               " WHERE published_at IS NOT NULL" % (db.table, hashed))
    db.execute("DROP INDEX %s.outbox_event_due_idx" % db.schema)
    holder = db.pg.connect()
    holder.autocommit = False
    builder = db.pg.connect()
    built, thread = [], None
    try:
        with holder.cursor() as cur:
            cur.execute("LOCK TABLE %s IN ROW EXCLUSIVE MODE" % db.table)

        def build():
            with builder.cursor() as cur:
                cur.execute("CREATE INDEX CONCURRENTLY outbox_event_due_idx ON %s"
                            " (available_at, aggregate_version) WHERE published_at IS NULL"
                            % db.table)
            built.append(True)

        thread = threading.Thread(target=build)
        thread.start()
        wait_until(lambda: db.execute(
            "SELECT 1 FROM pg_stat_progress_create_index p JOIN pg_class c"
            " ON c.oid = p.index_relid WHERE c.relname = 'outbox_event_due_idx'"
            " AND c.relnamespace = %s::regnamespace", (db.schema,)), 20,
            what="the index build under way")
        with Relay("outbox-relay", env=env, log_dir=tmp_path / "building") as relay:
            wait_until(checked(port), 20, what="the first table sample")
            assert relay.stop() == 0
            assert findings(relay) == [
                ("info", "index being built", "outbox_event_due_idx", None),
                ("warn", "index differs from its definition", "outbox_event_agg_published_idx",
                 "schemas/postgres/007_guard_split.sql"),
                ("warn", "old guard index on the table", "outbox_event_agg_idx",
                 "schemas/postgres/007_guard_split.sql")]
    finally:
        holder.rollback()
        holder.close()
        if thread:
            thread.join(30)
        builder.close()
    assert built == [True]

    # under OUTBOX_ORDERING=none only the due index is read: the guard index
    # built wrong is not the relay's concern, and the old one is unused; a
    # guard index of another's definition under the published one's name
    db.execute("DROP INDEX %s.outbox_event_agg_published_idx" % db.schema)
    db.execute("CREATE INDEX outbox_event_agg_published_idx ON %s (%s, aggregate_version)"
               " WHERE published_at IS NULL" % (db.table, hashed))
    env_none = dict(env, OUTBOX_ORDERING="none")
    with Relay("outbox-relay", env=env_none, log_dir=tmp_path / "none") as relay:
        wait_until(checked(port), 20, what="the first table sample")
        assert relay.stop() == 0
        assert findings(relay) == [
            ("info", "old guard index on the table", "outbox_event_agg_idx", None)]
    # ... which under the default ordering is missing, not to be rebuilt: the
    # index of its name serves the unpublished versions
    with Relay("outbox-relay", env=env, log_dir=tmp_path / "taken") as relay:
        wait_until(checked(port), 20, what="the first table sample")
        assert relay.stop() == 0
        assert findings(relay) == [
            ("warn", "index missing", "outbox_event_agg_published_idx",
             "schemas/postgres/007_guard_split.sql"),
            ("warn", "old guard index on the table", "outbox_event_agg_idx",
             "schemas/postgres/007_guard_split.sql")]


def test_relay_checks_its_indexes_again_when_the_lock_starts_timing_out(db, kafka, tmp_path):
    # a guard index lost while the relay runs: its lock statements time out,
    # and the index check, run again then, names what is lost
    def missing(relay):
        return [r for r in log_records(relay.log_text()) if r.get("index") ==
                "outbox_event_agg_published_idx" and r["msg"].startswith("index missing")]

    db.execute("DROP INDEX %s.outbox_event_agg_published_idx" % db.schema)
    port = free_port()
    env = relay_env(db, kafka, OUTBOX_HTTP_ADDR="127.0.0.1:%d" % port,
                    OUTBOX_STATEMENT_TIMEOUT_MS=300, OUTBOX_DB_LOCK_TIMEOUT_MS=60000)
    holder = db.pg.connect()
    holder.autocommit = False
    try:
        with Relay("outbox-relay", env=env, log_dir=tmp_path) as relay:
            wait_until(lambda: missing(relay), 20, what="the check at start")
            before = len(missing(relay))  # more if a lock timed out already
            # the lock statement's UPDATE waits past the statement timeout
            # (57014); reads, the index check's among them, go on
            with holder.cursor() as cur:
                cur.execute("LOCK TABLE %s IN SHARE MODE" % db.table)
            wait_until(lambda: len(missing(relay)) > before, 20,
                       what="the check again once the lock statement timed out")
            holder.rollback()
            records = log_records(relay.log_text())
            timeouts = [i for i, r in enumerate(records)
                        if r.get("statement") == "lock" and r.get("sqlstate") == "57014"]
            again = [i for i, r in enumerate(records)
                     if r.get("index") == "outbox_event_agg_published_idx"][before]
            assert timeouts and timeouts[0] < again, records
            db.insert_events(make_events(aggregates=3, versions=2))
            wait_until(published(db, 6), 30, what="rows published after the lock")
            assert relay.stop() == 0
    finally:
        holder.rollback()
        holder.close()


def test_invalid_headers_json_goes_dead(db, kafka, tmp_path):
    db.insert_events([
        {"aggregate_type": "Order", "aggregate_id": "h1", "aggregate_version": 1,
         "event_type": "E", "payload_json": {}, "headers_json": "[1, 2]"},
        {"aggregate_type": "Order", "aggregate_id": "h2", "aggregate_version": 1,
         "event_type": "E", "payload_json": {}}])
    with Relay("outbox-relay", env=relay_env(db, kafka), log_dir=tmp_path) as relay:
        wait_until(lambda: db.status_counts()["DEAD"] == 1 and db.status_counts()["PUBLISHED"] == 1,
                   30, what="h1 DEAD, h2 PUBLISHED")
        assert relay.stop() == 0
    (dead,) = db.rows(where="status = 'DEAD'")
    assert dead["aggregate_id"] == "h1" and dead["last_error_code"] == "INVALID_HEADERS"


def test_notify_wakes_idle_relay(db, kafka, tmp_path):
    # A poll interval far longer than the test: only NOTIFY can wake the relay.
    with Relay("outbox-relay", env=relay_env(db, kafka, OUTBOX_POLL_INTERVAL_MS=600000),
               log_dir=tmp_path) as relay:
        relay.wait_log(r"connected", 20)
        db.insert_events(make_events(aggregates=3, versions=1))
        wait_until(published(db, 3), 10, what="rows published after NOTIFY")
        assert relay.stop() == 0


def test_sigterm_leaves_no_publishing_rows_and_password_is_not_logged(db, kafka, tmp_path):
    db.insert_events(make_events(aggregates=200, versions=10, payload_size=200))
    env = relay_env(db, kafka, OUTBOX_RELAY_ID="relay-term", OUTBOX_BATCH_SIZE=100,
                    OUTBOX_LOG_LEVEL="debug")
    relay = Relay("outbox-relay", env=env, log_dir=tmp_path)
    wait_until(lambda: db.status_counts()["PUBLISHED"] > 0, 30, what="publishing started")
    assert relay.stop(signal.SIGTERM, timeout=60) == 0
    assert db.count("status = 'PUBLISHING' AND locked_by = 'relay-term'") == 0
    assert db.count("status = 'PUBLISHING'") == 0
    log = relay.log_text()
    assert "outbox-secret" not in log and "****" in log
    # what was marked PUBLISHED is on Kafka
    msgs = read_topics(kafka.bootstrap, topics=["%s.Order" % db.schema])
    got = {header(m, "event-id") for m in msgs}
    pub = {r["outbox_id"] for r in db.rows(where="status = 'PUBLISHED'")}
    assert pub <= got


def run_bad(env, tmp_path, args=()):
    r = Relay("outbox-relay", env=env, args=args, log_dir=tmp_path, name="bad")
    code = r.wait(20)
    return code, r.log_text()


def test_bad_configuration_exits_2_naming_the_variable(db, kafka, tmp_path):
    base = relay_env(db, kafka)
    cases = [
        ({"OUTBOX_BATCH_SIZE": "lots"}, "OUTBOX_BATCH_SIZE"),
        ({"OUTBOX_ORDERING": "chaos"}, "OUTBOX_ORDERING"),
        ({"OUTBOX_TABLE": "x;drop"}, "OUTBOX_TABLE"),
        ({"OUTBOX_KAFKA_NO_SUCH_PROPERTY": "1"}, "OUTBOX_KAFKA_NO_SUCH_PROPERTY"),
        ({"OUTBOX_KAFKA_ENABLE_IDEMPOTENCE": "false"}, "OUTBOX_KAFKA_ENABLE_IDEMPOTENCE"),
        ({"OUTBOX_KAFKA_BOOTSTRAP_SERVERS": ""}, "OUTBOX_KAFKA_BOOTSTRAP_SERVERS"),
        ({"OUTBOX_DATABASE_URL": ""}, "OUTBOX_DATABASE_URL"),
    ]
    for extra, var in cases:
        code, log = run_bad({**base, **extra}, tmp_path)
        assert code == 2, (extra, code, log)
        assert var in log, (extra, log)
        assert "outbox-secret" not in log
    code, log = run_bad(base, tmp_path, args=["--no-such-flag", "1"])
    assert code == 2 and "--no-such-flag" in log
    # nothing was touched
    assert db.status_counts() == {s: 0 for s in db.status_counts()}


def test_help_and_version(tmp_path):
    r = Relay("outbox-relay", args=["--help"], log_dir=tmp_path, name="help")
    assert r.wait(10) == 0
    assert "OUTBOX_DATABASE_URL" in r.log_text()
    r = Relay("outbox-relay", args=["--version"], log_dir=tmp_path, name="version")
    assert r.wait(10) == 0
    # the schema it is written for: the highest migration
    level = max(int(os.path.basename(p).split("_")[0]) for p in glob.glob(
        os.path.join(harness.repo_root(), "schemas", "postgres", "[0-9]*_*.sql")))
    assert re.search(r"^outbox-relay \S+ \(schema %d\)$" % level, r.log_text(), re.M), \
        r.log_text()


def test_librdkafka_binds_zstd_streams_to_the_relay(tmp_path):
    """common/zstd_reuse.c keeps one zstd context per librdkafka thread: that
    works only while the dynamic linker binds librdkafka's ZSTD_createCStream
    and ZSTD_freeCStream to the relay's own definitions."""
    r = Relay("outbox-relay", args=["--version"], env={"LD_DEBUG": "bindings"}, log_dir=tmp_path,
              name="bindings")
    assert r.wait(10) == 0
    text = r.log_text()
    for sym in ("ZSTD_createCStream", "ZSTD_freeCStream"):
        lines = [ln for ln in text.splitlines() if "librdkafka" in ln and "`%s'" % sym in ln]
        assert lines, "librdkafka does not call %s here (no zstd?)" % sym
        assert all("outbox-relay" in ln.split(" to ", 1)[1] for ln in lines), lines


def test_hot_aggregates_publish_runs_of_versions_per_batch(db, kafka, tmp_path):
    # 5 aggregates x 60 versions: the guard lets a batch take a run of consecutive
    # versions of one aggregate (published in version order, n+1 after n's ack),
    # instead of one version per aggregate per batch.
    rows = make_events(aggregates=5, versions=60)
    # aggregate a0's version 3 is poison: 4.. of a0 in the same batch must be given
    # back unattempted, never published before 3
    rows[2 * 5]["payload_json"] = {"pad": "x" * 1_100_000}
    db.insert_events(rows)
    env = relay_env(db, kafka, OUTBOX_LOG_LEVEL="debug")
    with Relay("outbox-relay", env=env, log_dir=tmp_path) as relay:
        wait_until(published(db, 4 * 60 + 2), 60, what="the healthy versions PUBLISHED")
        wait_until(lambda: db.status_counts()["DEAD"] == 1, 30, what="a0 v3 DEAD")
        assert relay.stop() == 0
        log = relay.log_text()
    sizes = [int(n) for n in re.findall(r'msg="batch done" rows=(\d+)', log)]
    assert max(sizes) > 5, sizes  # more than one version per aggregate in a batch
    assert len(sizes) < 20, sizes  # 302 rows did not take one batch per version
    (dead,) = db.rows(where="status = 'DEAD'")
    assert (dead["aggregate_id"], dead["aggregate_version"]) == ("a0", 3)
    held = db.rows(where="aggregate_id = 'a0' AND aggregate_version > 3")
    assert {r["status"] for r in held} == {"PENDING"}
    assert all(r["attempt_count"] == 0 for r in held)  # given back unattempted
    assert all(r["attempt_count"] == 1 for r in db.rows(where="status = 'PUBLISHED'"))
    msgs = read_topics(kafka.bootstrap, topics=["%s.Order" % db.schema])
    assert len(msgs) == 4 * 60 + 2 and count_duplicates(msgs) == 0
    ok, details = check_order(msgs)
    assert ok, details
    a0 = [int(header(m, "aggregate-version")) for m in sorted(msgs, key=lambda m: m["offset"])
          if m["key"] == "a0"]
    assert a0 == [1, 2]


def test_ordering_none_publishes_without_the_guard(db, kafka, tmp_path):
    # Without the guard a FAILED/DEAD version does not hold back the later ones.
    rows = make_events(aggregates=3, versions=4)
    rows[0]["headers_json"] = "[1]"  # a0 v1 goes DEAD (INVALID_HEADERS)
    db.insert_events(rows)
    with Relay("outbox-relay", env=relay_env(db, kafka, OUTBOX_ORDERING="none"),
               log_dir=tmp_path) as relay:
        wait_until(published(db, 11), 30, what="every other row PUBLISHED")
        assert relay.stop() == 0
    assert db.status_counts()["DEAD"] == 1
    msgs = read_topics(kafka.bootstrap, topics=["%s.Order" % db.schema])
    assert sorted(int(header(m, "aggregate-version")) for m in msgs if m["key"] == "a0") == [2, 3, 4]


def test_relay_takes_back_rows_its_id_left_locked(db, kafka, tmp_path):
    # A relay process with this id died holding rows (a container restart keeps
    # the pod name, the chart's relay id): the next one takes them back at once,
    # without the sweeper; a row that already used up its attempts goes DEAD
    # instead of looping through crashes forever.
    ids = db.insert_events(make_events(aggregates=3, versions=1))
    db.execute("UPDATE %s SET status = 'PUBLISHING', locked_by = 'pod-a', locked_at = now(),"
               " attempt_count = CASE WHEN aggregate_id = 'a2' THEN 3 ELSE 1 END" % db.table)
    env = relay_env(db, kafka, OUTBOX_RELAY_ID="pod-a", OUTBOX_MAX_ATTEMPTS=3)
    with Relay("outbox-relay", env=env, log_dir=tmp_path) as relay:
        wait_until(published(db, 2), 20, what="orphaned rows published")
        assert relay.stop() == 0
        assert "took back rows locked under this relay id" in relay.log_text()
    rows = {r["outbox_id"]: r for r in db.rows()}
    assert rows[ids[2]]["status"] == "DEAD" and rows[ids[2]]["last_error_code"] == "STALE_LOCK"
    assert [rows[i]["attempt_count"] for i in ids[:2]] == [2, 2]
