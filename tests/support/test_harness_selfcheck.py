"""Self-check of the test harness against a real PostgreSQL and the mock broker.

    /usr/bin/python3 -m pytest -q tests/support/test_harness_selfcheck.py

Needs deploy/local/pg (or OUTBOX_TEST_DATABASE_URL) and a built
outbox-mockbroker under OUTBOX_BUILD_DIR (those tests skip otherwise).
"""

import os
import select
import shutil
import signal
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
from harness import (MockBroker, MockBrokerError, Postgres, Relay, TestSchema,  # noqa: E402
                     check_order, count_duplicates, make_events, read_topics, wait_until)

needs_mock = pytest.mark.skipif(not harness.have_binary("outbox-mockbroker"),
                                reason="outbox-mockbroker not built")


@pytest.fixture(scope="module")
def pg():
    with Postgres() as server:
        yield server


@pytest.fixture(scope="module")
def kafka(tmp_path_factory):
    if not harness.have_binary("outbox-mockbroker"):
        pytest.skip("outbox-mockbroker not built")
    with MockBroker(["orders:3", "single:1"], log_dir=tmp_path_factory.mktemp("mock")) as mb:
        yield mb


# ------------------------------------------------------------------ PostgreSQL

def test_schema_insert_and_read(pg):
    with TestSchema(pg, "Insert-Read") as db:
        assert db.schema.startswith("t_insert_read_")
        ids = db.insert_events(make_events(aggregates=3, versions=2, topic="orders"))
        ids += db.insert_events([{"aggregate_type": "Order", "aggregate_id": "x",
                                  "aggregate_version": 1, "event_type": "Gone",
                                  "payload_json": None, "headers_json": '{"k": "v"}',
                                  "status": "DEAD"}])
        assert len(ids) == 7 and len(set(ids)) == 7
        assert db.status_counts() == {"PENDING": 6, "PUBLISHING": 0, "PUBLISHED": 0,
                                      "FAILED": 0, "DEAD": 1}
        rows = db.rows(order_by="aggregate_id, aggregate_version")
        assert [r["aggregate_id"] for r in rows[:2]] == ["a0", "a0"]
        assert rows[0]["payload_json"] == {"agg": 0, "v": 1, "pad": ""}
        dead = db.rows(where="status = %s", params=("DEAD",))
        assert dead[0]["payload_json"] is None and dead[0]["headers_json"] == {"k": "v"}
        assert dead[0]["outbox_id"] == ids[-1]
        assert db.count("tenant_id = 'default'") == 7
        # The table is in the test schema, not in public.
        assert db.execute("SELECT to_regclass(%s) IS NOT NULL AS ok", (db.table,))[0]["ok"]
    conn = pg.connect()
    with conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_namespace WHERE nspname = %s", (db.schema,))
        assert cur.fetchone()[0] == 0
    conn.close()


def test_insert_notifies(pg):
    with TestSchema(pg, "notify") as db:
        listener = pg.connect()
        with listener.cursor() as cur:
            cur.execute('LISTEN "%s.outbox_event"' % db.schema)
        db.insert_events(make_events(aggregates=2))
        select.select([listener], [], [], 5)
        listener.poll()
        assert any(n.channel == "%s.outbox_event" % db.schema for n in listener.notifies)
        listener.close()


def test_restart_and_terminate(pg):
    if not pg.restartable:
        pytest.skip("shared server without OUTBOX_TEST_PG_DIR")
    with TestSchema(pg, "restart") as db:
        other = pg.connect(application_name="victim")
        assert pg.terminate_backends("victim") == 1
        pg.restart()
        wait_until(pg.ready, 10, what="server back")
        db.conn.close()  # the old session died with the restart
        db.conn = pg.connect()
        db.execute("SET search_path TO %s" % db.schema)
        db.insert_events(make_events())
        assert db.status_counts()["PENDING"] == 1
        other.close()


# ------------------------------------------------------------------ mock Kafka

def _produce(bootstrap, topic, messages):
    """messages: list of (key, value, headers) via kcat, synchronously."""
    if shutil.which("kcat") is None:
        pytest.skip("kcat missing")
    for key, value, headers in messages:
        cmd = ["kcat", "-b", bootstrap, "-P", "-t", topic, "-k", key,
               "-X", "message.timeout.ms=5000"]
        for k, v in headers:
            cmd += ["-H", "%s=%s" % (k, v)]
        r = subprocess.run(cmd, input=value.encode(), capture_output=True, timeout=30)
        if r.returncode != 0:
            return r
    return None


def _event_headers(agg, version, eid):
    return [("event-id", eid), ("tenant-id", "default"), ("aggregate-type", "Order"),
            ("aggregate-id", agg), ("aggregate-version", str(version))]


@needs_mock
def test_mock_control(kafka):
    assert kafka.ping() == "pong"
    assert kafka.down(2) == "broker 2 down"
    assert kafka.up(2) == "broker 2 up"
    assert kafka.produce_errors(2, "NOT_ENOUGH_REPLICAS") == "2 NOT_ENOUGH_REPLICAS"
    kafka.clear_errors()
    kafka.create_topic("created.later", 5)
    with pytest.raises(MockBrokerError, match="unknown error name"):
        kafka.produce_errors(1, "NO_SUCH_ERROR")
    with pytest.raises(MockBrokerError, match="already exists"):
        kafka.create_topic("created.later", 5)


@needs_mock
def test_mock_roundtrip_and_order(kafka):
    msgs = [("o1", '{"v":1}', _event_headers("o1", 1, "e1")),
            ("o1", '{"v":2}', _event_headers("o1", 2, "e2")),
            ("o1", '{"v":1}', _event_headers("o1", 1, "e1")),  # redelivered copy
            ("o2", "plain", _event_headers("o2", 1, "e3"))]
    assert _produce(kafka.bootstrap, "single", msgs) is None
    got = read_topics(kafka.bootstrap, topics=["single"])
    assert [m["offset"] for m in got] == [0, 1, 2, 3]
    assert got[0]["key"] == "o1" and got[0]["value"] == '{"v":1}'
    assert ["aggregate-version", "1"] in got[0]["headers"]
    ok, details = check_order(got)
    assert ok, details
    assert count_duplicates(got) == 1
    assert read_topics(kafka.bootstrap, pattern=r"^sing") == got


@needs_mock
def test_mock_down_up(kafka):
    kafka.down()
    try:
        r = _produce(kafka.bootstrap, "orders", [("k", "lost", [])])
        assert r is not None and r.returncode != 0
    finally:
        kafka.up()
    assert _produce(kafka.bootstrap, "orders", [("k", "after-up", [])]) is None
    assert [m["value"] for m in read_topics(kafka.bootstrap, topics=["orders"])] == ["after-up"]


def test_check_order_detects_violation():
    def m(off, agg, v, eid):
        return {"topic": "t", "partition": 0, "offset": off,
                "headers": [[k, val] for k, val in _event_headers(agg, v, eid)]}
    ok, details = check_order([m(0, "a", 2, "x2"), m(1, "a", 1, "x1")])
    assert not ok and "version 1 after version 2" in details[0]
    ok, _ = check_order([m(0, "a", 1, "x1"), m(1, "b", 1, "y1"), m(2, "a", 2, "x2"),
                         m(3, "a", 1, "x1")])
    assert ok
    ok, details = check_order([{"topic": "t", "partition": 0, "offset": 0, "headers": []}])
    assert not ok and "missing" in details[0]


# ------------------------------------------------------------------ processes

def test_relay_process(tmp_path, monkeypatch):
    monkeypatch.setenv("ASAN_OPTIONS", "detect_leaks=1")
    monkeypatch.setenv("SECRET_NOT_PASSED", "1")
    script = ("echo started $FOO ${ASAN_OPTIONS} ${SECRET_NOT_PASSED:-absent}; "
              "trap 'echo bye; exit 0' TERM; while :; do sleep 0.02; done")
    with Relay("/bin/sh", env={"FOO": "bar"}, args=["-c", script], log_dir=tmp_path,
               name="fake") as r:
        r.wait_log(r"started bar detect_leaks=1 absent")
        assert r.running() and r.pid > 0
        assert r.stop(signal.SIGTERM, timeout=5) == 0
    assert "bye" in r.log_text()
    assert (tmp_path / "fake.log").exists()
    with Relay("/bin/sh", args=["-c", "exit 2"], log_dir=tmp_path, name="bad") as r:
        assert r.wait(5) == 2
    with Relay("/bin/sh", args=["-c", "trap '' TERM; while :; do sleep 0.02; done"],
               log_dir=tmp_path, name="stubborn") as r:
        assert r.kill() == -signal.SIGKILL


def test_paths(monkeypatch, tmp_path):
    monkeypatch.setenv("OUTBOX_BUILD_DIR", str(tmp_path))
    assert harness.bin_path("relay") == str(tmp_path / "relay" / "outbox-relay")
    assert harness.bin_path("outbox-sweeper") == str(tmp_path / "sweeper" / "outbox-sweeper")
    assert harness.bin_path("mockbroker").endswith("deploy/local/outbox-mockbroker")
    assert os.path.isfile(os.path.join(harness.repo_root(), "deploy", "local", "pg"))
    with pytest.raises(AssertionError, match="never"):
        wait_until(lambda: False, 0.1, what="never")
