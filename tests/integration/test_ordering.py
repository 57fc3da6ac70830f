"""Per-aggregate order when transactions commit out of version order, and gaps
(docs/DESIGN.md, "Per-aggregate order"): against Apache Kafka, every check reads
the topic back. A version that is held is shown held by a witness: a row of
another aggregate inserted after it is PUBLISHED first, so the relay has locked
batches since the held row was visible."""
import json
import os
import subprocess
import urllib.request

import psycopg2
import pytest

from conftest import relay_env
from harness import (Relay, bin_path, check_order, free_port, header, read_topics,
                     wait_until)

OUTBOXCTL = bin_path("outboxctl")


def row(agg, version, **kw):
    r = {"aggregate_type": "Order", "aggregate_id": agg, "aggregate_version": version,
         "event_type": "E%d" % version, "payload_json": {"agg": agg, "v": version}}
    r.update(kw)
    return r


def status(db, agg, version):
    rows = db.rows(where="aggregate_id = %s AND aggregate_version = %s", params=(agg, version))
    return rows[0]["status"] if rows else None


def versions_on_kafka(db, kafka, agg):
    """The aggregate's versions in partition order (first copies), and all messages."""
    msgs = read_topics(kafka.bootstrap, topics=["%s.Order" % db.schema])
    ok, details = check_order(msgs)
    assert ok, details
    seen = []
    for m in sorted(msgs, key=lambda m: (m["partition"], m["offset"])):
        if m["key"] == agg:
            v = int(header(m, "aggregate-version"))
            if v not in seen:
                seen.append(v)
    return seen, msgs


def witness(db, name):
    """Inserts a row of a fresh aggregate and waits until it is PUBLISHED: the
    relay has locked (at least) one batch after everything committed before."""
    db.insert_events([row(name, 1)])
    wait_until(lambda: status(db, name, 1) == "PUBLISHED", 30, what="witness %s PUBLISHED" % name)


def due_scans(db):
    """Scans of the table's due index so far (each lock statement makes one;
    backends report their counters within about a second)."""
    r = db.execute("SELECT coalesce(sum(idx_scan), 0)::bigint AS n FROM pg_stat_user_indexes"
                   " WHERE schemaname = %s AND indexrelname = 'outbox_event_due_idx'",
                   (db.schema,))
    return r[0]["n"]


def open_tx(pg, rows_sql):
    """A transaction of its own that inserted rows and stays open."""
    conn = psycopg2.connect(pg.url)
    cur = conn.cursor()
    for sql, params in rows_sql:
        cur.execute(sql, params)
    return conn


def insert_sql(db, agg, version):
    return ("INSERT INTO %s (aggregate_type, aggregate_id, aggregate_version, event_type,"
            " payload_json) VALUES ('Order', %%s, %%s, %%s, %%s)" % db.table,
            (agg, version, "E%d" % version, json.dumps({"agg": agg, "v": version})))


def test_late_commit_is_held_until_its_predecessor_commits(db, kafka, tmp_path):
    # T1 inserts version 1 and stays open; T2 inserts version 2 and commits.
    t1 = open_tx(db.pg, [insert_sql(db, "late", 1)])
    try:
        db.insert_events([row("late", 2)])
        with Relay("outbox-relay", env=relay_env(db, kafka), log_dir=tmp_path) as relay:
            witness(db, "w1")
            assert status(db, "late", 2) == "PENDING"
            t1.commit()
            wait_until(lambda: status(db, "late", 2) == "PUBLISHED", 30,
                       what="version 2 PUBLISHED once version 1 committed")
            assert relay.stop() == 0
    finally:
        t1.close()
    seen, _ = versions_on_kafka(db, kafka, "late")
    assert seen == [1, 2]


def test_gap_is_held_until_the_missing_version_commits(db, kafka, tmp_path):
    db.insert_events([row("gap", 1), row("gap", 3)])
    with Relay("outbox-relay", env=relay_env(db, kafka), log_dir=tmp_path) as relay:
        wait_until(lambda: status(db, "gap", 1) == "PUBLISHED", 30, what="version 1 PUBLISHED")
        witness(db, "w2")
        assert status(db, "gap", 3) == "PENDING"
        db.insert_events([row("gap", 2)])
        wait_until(lambda: status(db, "gap", 3) == "PUBLISHED", 30,
                   what="version 3 PUBLISHED once version 2 committed")
        assert relay.stop() == 0
    seen, _ = versions_on_kafka(db, kafka, "gap")
    assert seen == [1, 2, 3]


def test_lower_version_due_after_more_than_a_window_of_its_successors(db, kafka, tmp_path):
    # A replay, a requeue or the sweeper makes a version due again later than
    # the versions after it. With more of those successors than one lock
    # takes (batch size 5: at most 20 rows), the window, ordered by due time,
    # holds only successors that may not go; the relay must still reach the
    # lower versions and publish everything in order.
    db.insert_events([row("replayed", v) for v in range(1, 61)])
    db.execute("UPDATE %s SET status = 'PUBLISHED', published_at = now()"
               " WHERE aggregate_version < 8" % db.table)
    db.execute("UPDATE %s SET available_at = now() - interval '1 minute'"
               " WHERE aggregate_version >= 8" % db.table)
    db.execute("UPDATE %s SET available_at = now() - interval '1 second'"
               " WHERE aggregate_version BETWEEN 8 AND 10" % db.table)
    env = relay_env(db, kafka, OUTBOX_BATCH_SIZE=5)
    with Relay("outbox-relay", env=env, log_dir=tmp_path) as relay:
        wait_until(lambda: db.count("status <> 'PUBLISHED'") == 0, 60, what="all PUBLISHED")
        assert relay.stop() == 0
    seen, _ = versions_on_kafka(db, kafka, "replayed")
    assert seen == list(range(8, 61))


def test_first_event_above_version_1_flows(db, kafka, tmp_path):
    # An aggregate whose first outbox event is not version 1 (the outbox came
    # after the aggregate) goes out once every older transaction has ended.
    db.insert_events([row("old", 57), row("old", 58)])
    with Relay("outbox-relay", env=relay_env(db, kafka), log_dir=tmp_path) as relay:
        wait_until(lambda: status(db, "old", 58) == "PUBLISHED", 30, what="versions 57, 58")
        assert relay.stop() == 0
    seen, _ = versions_on_kafka(db, kafka, "old")
    assert seen == [57, 58]


def test_late_version_goes_dead_and_holds_nothing(db, kafka, tmp_path):
    db.insert_events([row("inv", 1), row("inv", 2)])
    with Relay("outbox-relay", env=relay_env(db, kafka), log_dir=tmp_path) as relay:
        wait_until(lambda: status(db, "inv", 2) == "PUBLISHED", 30, what="versions 1, 2")
        # the application commits a version below one already on Kafka: it
        # cannot go out in order, so it goes DEAD, loudly, and is not published
        db.insert_events([row("inv", 0, event_type="Late")])
        wait_until(lambda: status(db, "inv", 0) == "DEAD", 30, what="late version DEAD")
        relay.wait_log(r"event dead.*LATE_VERSION", 10)
        (dead,) = db.rows(where="status = 'DEAD'")
        assert dead["last_error_code"] == "LATE_VERSION"
        assert "version 0" in dead["last_error_message"]
        # unlike other DEAD rows it holds nothing: its place in the order is
        # lost already (version 2 is on Kafka), so the versions after the
        # published ones follow them; the sweeper parks nothing behind it
        sweeper = Relay("outbox-sweeper", env={**relay_env(db, kafka), "OUTBOX_RETENTION_S": "0"},
                        args=["--once"], log_dir=tmp_path, name="sweeper")
        assert sweeper.wait(60) == 0
        db.insert_events([row("inv", 3)])
        wait_until(lambda: status(db, "inv", 3) == "PUBLISHED", 30,
                   what="version 3 PUBLISHED past the late row")
        assert status(db, "inv", 0) == "DEAD"
        assert relay.stop() == 0
    seen, _ = versions_on_kafka(db, kafka, "inv")
    assert seen == [1, 2, 3]


def test_a_version_below_a_published_one_goes_dead_whatever_lies_between(db, kafka, tmp_path):
    # Set up by hand as the table can come to be, before any relay runs:
    # - req: versions 1, 2 and 4-10 PUBLISHED; its late version 3 requeued by
    #   an operator (PENDING again); 11-15 committed since. One lock window
    #   holds 3 and 11-15, and the published 4-10 lie inside its range.
    # - hid: its late version 3 DEAD (LATE_VERSION), 4 PUBLISHED (the rows
    #   below deleted by retention), and version 2 committed only now: the
    #   lowest version above it is the late one, the published one above that.
    # Neither may reach Kafka after the versions published above it: both go
    # DEAD as late, and req 11-15 go, in order.
    published = [v for v in range(1, 11) if v != 3]
    db.insert_events([row("req", v) for v in range(1, 16)] + [row("hid", 3), row("hid", 4)])
    db.execute("UPDATE %s SET status = 'PUBLISHED', published_at = now()"
               " WHERE (aggregate_id = 'req' AND aggregate_version = ANY(%%s))"
               " OR (aggregate_id = 'hid' AND aggregate_version = 4)" % db.table, (published,))
    db.execute("UPDATE %s SET status = 'DEAD', available_at = 'infinity', attempt_count = 1,"
               " last_error_code = 'LATE_VERSION', last_error_message = 'version 3 committed"
               " after version 5 was published'"
               " WHERE aggregate_id = 'hid' AND aggregate_version = 3" % db.table)
    db.insert_events([row("hid", 2)])
    with Relay("outbox-relay", env=relay_env(db, kafka), log_dir=tmp_path) as relay:
        wait_until(lambda: status(db, "req", 15) == "PUBLISHED" and status(db, "req", 3) == "DEAD"
                   and status(db, "hid", 2) == "DEAD", 30,
                   what="req 11-15 PUBLISHED, req/3 and hid/2 DEAD")
        assert relay.stop() == 0
    for agg, v, above in (("req", 3, 10), ("hid", 2, 4)):
        (r,) = db.rows(where="aggregate_id = %s AND aggregate_version = %s", params=(agg, v))
        assert r["last_error_code"] == "LATE_VERSION", r
        assert "after version %d was published" % above in r["last_error_message"], r
    assert versions_on_kafka(db, kafka, "req")[0] == list(range(11, 16))
    assert versions_on_kafka(db, kafka, "hid")[0] == []


@pytest.mark.parametrize("ordering", ["aggregate", "none"])
def test_a_requeued_late_version_no_longer_late_is_sent_without_its_code(db, kafka, tmp_path,
                                                                          ordering):
    # A late version 1 requeued (PENDING, code LATE_VERSION left from its DEAD
    # mark) once retention deleted the published version above it: nothing
    # above it is published, so it is no longer late. Its lock clears the code
    # (other lock statements skip a late-coded row in flight, and version 2
    # would then count as the aggregate's first), and 1 and 2 go in order.
    db.insert_events([row("req", 1, last_error_code="LATE_VERSION",
                          last_error_message="version 1 committed after version 2 was"
                                             " published"), row("req", 2)])
    env = relay_env(db, kafka, OUTBOX_ORDERING=ordering)
    with Relay("outbox-relay", env=env, log_dir=tmp_path) as relay:
        wait_until(lambda: status(db, "req", 1) == status(db, "req", 2) == "PUBLISHED", 30,
                   what="req 1-2 PUBLISHED")
        assert relay.stop() == 0
    (r,) = db.rows(where="aggregate_id = 'req' AND aggregate_version = 1")
    assert (r["status"], r["last_error_code"], r["last_error_message"]) == \
        ("PUBLISHED", None, None), r
    if ordering == "aggregate":
        assert versions_on_kafka(db, kafka, "req")[0] == [1, 2]
    else:  # no order promised: both there
        msgs = read_topics(kafka.bootstrap, topics=["%s.Order" % db.schema])
        assert sorted(int(header(m, "aggregate-version")) for m in msgs) == [1, 2], msgs


def scrape(addr):
    with urllib.request.urlopen("http://%s/metrics" % addr, timeout=5) as r:
        return r.read().decode()


def gauge(text, name):
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def outboxctl(db, *args):
    env = {**os.environ, "OUTBOX_DATABASE_URL": db.pg.url, "OUTBOX_TABLE": db.table}
    return subprocess.run([OUTBOXCTL, *args], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=60)


def test_lasting_gap_is_reported_and_released_by_the_operator(db, kafka, tmp_path):
    db.insert_events([row("hole", 1), row("hole", 4), row("hole", 5), row("fine", 1),
                      row("fine", 2)])
    addr = "127.0.0.1:%d" % free_port()
    env = relay_env(db, kafka, OUTBOX_HTTP_ADDR=addr, OUTBOX_LOG_FORMAT="json")
    with Relay("outbox-relay", env=env, log_dir=tmp_path) as relay:
        wait_until(lambda: status(db, "fine", 2) == "PUBLISHED", 30, what="other aggregate")
        # the gauge comes from the table sample (every 10 s)
        wait_until(lambda: gauge(scrape(addr), "outbox_version_gaps") == 1, 30,
                   what="outbox_version_gaps 1")
        assert gauge(scrape(addr), "outbox_version_gap_age_seconds") >= 0
        line = relay.wait_log(r'\{[^\n]*"msg":"version gap holds an aggregate"[^\n]*\}', 30)
        logged = json.loads(line.group(0))
        assert logged["aggregate_id"] == "hole" and logged["aggregate_type"] == "Order"
        assert logged["missing_from"] == "2" and logged["missing_to"] == "3"
        assert logged["held_version"] == "4"
        assert [status(db, "hole", v) for v in (1, 4, 5)] == ["PUBLISHED", "PENDING", "PENDING"]

        listed = outboxctl(db, "gaps")
        assert listed.returncode == 0, listed.stderr
        assert "Order/hole" in listed.stdout and "2-3" in listed.stdout, listed.stdout
        released = outboxctl(db, "release-gap", "--aggregate", "Order/hole")
        assert released.returncode == 0, released.stderr
        assert "released" in released.stdout
        wait_until(lambda: status(db, "hole", 5) == "PUBLISHED", 30,
                   what="held versions PUBLISHED after the release")
        wait_until(lambda: gauge(scrape(addr), "outbox_version_gaps") == 0, 30,
                   what="outbox_version_gaps back to 0")
        assert relay.stop() == 0
    seen, msgs = versions_on_kafka(db, kafka, "hole")
    assert seen == [1, 4, 5]
    # the release is on record in the table, not on Kafka
    (mark,) = db.rows(where="last_error_code = 'GAP_RELEASED'")
    assert mark["status"] == "PUBLISHED" and mark["aggregate_version"] == 3
    assert mark["outbox_id"] not in {header(m, "event-id") for m in msgs}
    assert outboxctl(db, "gaps").stdout.count("Order/") == 0


@pytest.mark.parametrize("mode", ["increasing", "none"])
def test_modes_for_versions_that_are_not_consecutive(db, kafka, tmp_path, mode):
    # versions with holes by design (e.g. from a sequence) flow in order
    db.insert_events([row("seq", 10), row("seq", 20), row("seq", 35)])
    with Relay("outbox-relay", env=relay_env(db, kafka, OUTBOX_ORDERING=mode),
               log_dir=tmp_path) as relay:
        wait_until(lambda: db.status_counts()["PUBLISHED"] == 3, 30, what="all PUBLISHED")
        assert relay.stop() == 0
    seen, _ = versions_on_kafka(db, kafka, "seq")
    assert sorted(seen) == [10, 20, 35]
    if mode == "increasing":
        assert seen == [10, 20, 35]


def test_increasing_mode_holds_a_late_commit(db, kafka, tmp_path):
    t1 = open_tx(db.pg, [insert_sql(db, "inc", 10)])
    try:
        db.insert_events([row("inc", 20)])
        env = relay_env(db, kafka, OUTBOX_ORDERING="increasing")
        with Relay("outbox-relay", env=env, log_dir=tmp_path) as relay:
            # Every row committed after T1 began waits for T1 here, so no
            # witness row can go first: count the relay's lock statements.
            before = due_scans(db)
            wait_until(lambda: due_scans(db) >= before + 3, 30,
                       what="the relay running lock statements")
            assert status(db, "inc", 20) == "PENDING"
            t1.commit()
            wait_until(lambda: status(db, "inc", 20) == "PUBLISHED", 30, what="version 20")
            assert relay.stop() == 0
    finally:
        t1.close()
    seen, _ = versions_on_kafka(db, kafka, "inc")
    assert seen == [10, 20]


def published_long_ago(db, agg, versions, hours=3):
    db.execute("INSERT INTO %s (aggregate_type, aggregate_id, aggregate_version, event_type,"
               " status, published_at, created_at, occurred_at)"
               " SELECT 'Order', %%s, v, 'E' || v, 'PUBLISHED', now() - %%s * interval '1 hour',"
               " now() - %%s * interval '1 hour', now() - %%s * interval '1 hour'"
               " FROM unnest(%%s::bigint[]) v" % db.table, (agg, hours, hours, hours, versions))


def sweep_once(db, tmp_path, name, **env):
    env = {**db.env(), "OUTBOX_HTTP_ADDR": "off", "OUTBOX_LOG_FORMAT": "text",
           "OUTBOX_RETENTION_S": "3600", "OUTBOX_RETENTION_KEEP_LATEST": "true", **env}
    sweeper = Relay("outbox-sweeper", env=env, args=["--once"], log_dir=tmp_path, name=name)
    assert sweeper.wait(60) == 0, sweeper.log_text()[-2000:]


def versions_left(db, agg):
    return [(r["aggregate_version"], r["available_at"].year == 9999)
            for r in db.rows(order_by="aggregate_version",
                             where="aggregate_id = %s", params=(agg,))]


def test_retention_keeps_each_aggregates_latest_row_so_a_later_gap_is_seen(db, kafka, tmp_path):
    published_long_ago(db, "kept", [1, 2, 3])
    published_long_ago(db, "solo", [1])
    # a late version 3, DEAD, between published 2 and 5: 2 is not the latest
    published_long_ago(db, "late", [1, 2, 5])
    db.execute("INSERT INTO %s (aggregate_type, aggregate_id, aggregate_version, event_type,"
               " status, available_at, last_error_code) VALUES ('Order', 'late', 3, 'E3',"
               " 'DEAD', 'infinity', 'LATE_VERSION')" % db.table)
    sweep_once(db, tmp_path, "sweep1")
    # versions 1 and 2 are gone; 3, the latest, stays, parked out of later scans
    assert versions_left(db, "kept") == [(3, True)]
    assert versions_left(db, "solo") == [(1, True)]
    assert versions_left(db, "late") == [(3, True), (5, True)]
    # version 5 after it: the gap (4) is seen even though 1-3 are long published
    db.insert_events([row("kept", 5)])
    with Relay("outbox-relay", env=relay_env(db, kafka), log_dir=tmp_path) as relay:
        witness(db, "w4")
        assert status(db, "kept", 5) == "PENDING"
        db.insert_events([row("kept", 4)])
        wait_until(lambda: status(db, "kept", 5) == "PUBLISHED", 30, what="versions 4, 5")
        assert relay.stop() == 0
    seen, _ = versions_on_kafka(db, kafka, "kept")
    assert seen == [4, 5]
    # once 4 and 5 are old too, 3 and 4 go and 5 is the one kept
    db.execute("UPDATE %s SET published_at = now() - interval '2 hours' WHERE aggregate_id ="
               " 'kept'" % db.table)
    sweep_once(db, tmp_path, "sweep2")
    assert versions_left(db, "kept") == [(5, True)]
    # by default (storage bounded) retention deletes every old row
    published_long_ago(db, "plain", [1, 2])
    sweep_once(db, tmp_path, "sweep2b", OUTBOX_RETENTION_KEEP_LATEST="false")
    assert versions_left(db, "plain") == []
    # without the consecutive rule nothing needs keeping
    sweep_once(db, tmp_path, "sweep3", OUTBOX_ORDERING="increasing")
    assert versions_left(db, "kept") == [(5, True)]  # parked rows are out of its range
    published_long_ago(db, "free", [1, 2])
    sweep_once(db, tmp_path, "sweep4", OUTBOX_ORDERING="none")
    assert versions_left(db, "free") == []
