"""outboxctl reconcile and replay against Apache Kafka (docs/DESIGN.md,
"outboxctl"): what reconcile reports after a clean run, for rows marked
PUBLISHED that never reached Kafka, for versions produced out of order, for
duplicates and unknown messages; a replayed aggregate (whole, or a middle
range selected by time) arrives again in order and reconcile still passes;
what replay refuses; usage errors.

Messages the tests produce themselves (out of order, duplicates, unknown) are
produced with confluent_kafka to a fixed partition."""
import json
import os
import re
import subprocess
import uuid

import psycopg2
import pytest
from confluent_kafka import Producer

from conftest import relay_env
from harness import Relay, bin_path, check_order, header, read_topics, wait_until

OUTBOXCTL = bin_path("outboxctl")


def ctl_env(db, kafka, **extra):
    env = {"OUTBOX_DATABASE_URL": db.pg.url, "OUTBOX_TABLE": db.table,
           "OUTBOX_TOPIC_TEMPLATE": "%s.{aggregate_type}" % db.schema,
           "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": kafka.bootstrap}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def outboxctl(env, *args, expect=None):
    base = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    r = subprocess.run([OUTBOXCTL, *map(str, args)], env={**base, **env},
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)
    if expect is not None:
        assert r.returncode == expect, (args, r.returncode, r.stdout, r.stderr)
    return r


def reconcile(db, kafka, *args, expect=0):
    r = outboxctl(ctl_env(db, kafka), "reconcile", "--json", *args, expect=expect)
    return json.loads(r.stdout)


def row(agg, v, **kw):
    r = {"aggregate_type": "Order", "aggregate_id": agg, "aggregate_version": v,
         "event_type": "E", "payload_json": {"agg": agg, "v": v}}
    r.update(kw)
    return r


def publish_all(db, kafka, tmp_path, rows, name="relay"):
    """Inserts rows and runs a relay until every row is PUBLISHED."""
    ids = db.insert_events(rows)
    with Relay("outbox-relay", env=relay_env(db, kafka), log_dir=tmp_path, name=name) as relay:
        wait_until(lambda: db.count("status <> 'PUBLISHED'") == 0, 60, what="all PUBLISHED")
        assert relay.stop() == 0
    return ids


def topic_of(db):
    return "%s.Order" % db.schema


def produce(kafka, topic, msgs, partition=0):
    """msgs: (key, headers dict) in order, to one partition."""
    p = Producer({"bootstrap.servers": kafka.bootstrap, "enable.idempotence": True})
    for key, headers in msgs:
        p.produce(topic, key=key, value=b"{}", partition=partition,
                  headers=[(k, str(v)) for k, v in headers.items()])
    assert p.flush(30) == 0


def headers_of(r):
    return {"event-id": r["outbox_id"], "tenant-id": r["tenant_id"],
            "aggregate-type": r["aggregate_type"], "aggregate-id": r["aggregate_id"],
            "aggregate-version": r["aggregate_version"]}


def first_copies(msgs, agg):
    """Versions of one aggregate in partition order, and all its versions in
    order (copies included)."""
    seen, all_ = [], []
    for m in sorted(msgs, key=lambda m: (m["partition"], m["offset"])):
        if m["key"] == agg:
            v = int(header(m, "aggregate-version"))
            all_.append(v)
            if v not in seen:
                seen.append(v)
    return seen, all_


KEYS = {"rows", "messages", "missing", "reorders", "duplicates", "unknown"}


def test_clean_run_reconciles(db, kafka, tmp_path):
    kafka.create_topic(topic_of(db), 4)
    rows = [row("a%d" % (i % 7), i // 7 + 1) for i in range(70)]
    publish_all(db, kafka, tmp_path, rows)
    out = reconcile(db, kafka)
    assert KEYS <= out.keys(), out
    for k in KEYS:
        assert isinstance(out[k], int), (k, out)
    assert out["rows"] == 70 and out["messages"] >= 70, out
    assert out["missing"] == 0 and out["reorders"] == 0 and out["unknown"] == 0, out
    assert out["missing_ids"] == [] and out["ok"] is True, out
    assert out["topics"] == [{"topic": topic_of(db), "rows": 70, "on_kafka": True}], out
    # the text report says the same, and exits 0
    text = outboxctl(ctl_env(db, kafka), "reconcile", expect=0).stdout
    assert "result: ok" in text and re.search(r"^missing +0 ", text, re.M), text
    # a window before any row: nothing to compare, nothing wrong
    out = reconcile(db, kafka, "--since", "3h", "--until", "2h")
    assert out["rows"] == 0 and out["missing"] == 0, out


def test_rows_published_by_hand_are_missing_exactly(db, kafka, tmp_path):
    kafka.create_topic(topic_of(db), 4)
    publish_all(db, kafka, tmp_path, [row("ok", 1), row("ok", 2)])
    ids = db.insert_events([row("ghost", 1), row("ghost", 2), row("other", 5)])
    db.execute("UPDATE %s SET status = 'PUBLISHED', published_at = now()"
               " WHERE outbox_id = ANY(%%s::uuid[])" % db.table, (ids,))
    out = reconcile(db, kafka, expect=1)
    assert out["missing"] == 3 and sorted(out["missing_ids"]) == sorted(ids), out
    assert out["missing_ids_truncated"] is False and out["ok"] is False, out
    assert out["rows"] == 5 and out["reorders"] == 0, out
    # --examples bounds the list, not the count
    out = reconcile(db, kafka, "--examples", "1", expect=1)
    assert out["missing"] == 3 and len(out["missing_ids"]) == 1, out
    assert out["missing_ids_truncated"] is True, out
    text = outboxctl(ctl_env(db, kafka), "reconcile", expect=1).stdout
    assert all(i in text for i in ids) and "result: PROBLEM: 3 missing" in text, text


def test_released_gap_is_not_missing(db, kafka, tmp_path):
    kafka.create_topic(topic_of(db), 4)
    db.insert_events([row("hole", 1), row("hole", 4)])
    env = relay_env(db, kafka)
    with Relay("outbox-relay", env=env, log_dir=tmp_path) as relay:
        wait_until(lambda: db.count("aggregate_version = 1 AND status = 'PUBLISHED'") == 1, 30,
                   what="version 1")
        r = outboxctl(ctl_env(db, kafka), "release-gap", "--aggregate", "Order/hole", expect=0)
        assert "released 2-3" in r.stdout
        wait_until(lambda: db.count("status <> 'PUBLISHED'") == 0, 30, what="version 4")
        assert relay.stop() == 0
    out = reconcile(db, kafka)
    assert out["rows"] == 2 and out["gap_released"] == 1 and out["missing"] == 0, out


def test_versions_out_of_order_are_one_reorder(db, kafka, tmp_path):
    topic = topic_of(db)
    kafka.create_topic(topic, 4)
    ids = db.insert_events([row("swap", 1), row("swap", 2)])
    db.execute("UPDATE %s SET status = 'PUBLISHED', published_at = now()" % db.table)
    r1, r2 = (db.rows(where="outbox_id = %s", params=(i,))[0] for i in ids)
    produce(kafka, topic, [("swap", headers_of(r2)), ("swap", headers_of(r1))])
    out = reconcile(db, kafka, expect=1)
    assert out["reorders"] == 1 and out["missing"] == 0, out
    (ex,) = out["reorder_examples"]
    assert ex["aggregate"] == "Order/swap" and ex["version"] == 1, ex
    assert ex["after_version"] == 2 and ex["partition"] == 0, ex
    # a later copy of version 1 after 2 is a duplicate, not another reorder
    produce(kafka, topic, [("swap", headers_of(r1))])
    out = reconcile(db, kafka, expect=1)
    assert out["reorders"] == 1 and out["duplicates"] == 1, out


def test_duplicates_and_unknown_are_counted_not_failures(db, kafka, tmp_path):
    topic = topic_of(db)
    kafka.create_topic(topic, 4)
    ids = publish_all(db, kafka, tmp_path, [row("d", 1), row("d", 2), row("e", 1)])
    msgs = read_topics(kafka.bootstrap, topics=[topic])
    first = next(m for m in msgs if header(m, "event-id") == ids[2])
    hdrs = dict(first["headers"])
    # a second copy of e/1 in its own partition, after its first
    produce(kafka, topic, [("e", hdrs)], partition=first["partition"])
    # two messages the table does not know: another id, and no event-id at all
    stranger = str(uuid.uuid4())
    produce(kafka, topic, [("x", {"event-id": stranger, "aggregate-type": "Order",
                                  "aggregate-id": "x", "aggregate-version": 1}),
                           ("y", {"aggregate-id": "y"})])
    out = reconcile(db, kafka, expect=0)
    assert out["duplicates"] == 1 and out["duplicate_copies"] == 1, out
    assert out["unknown"] == 2 and out["missing"] == 0 and out["reorders"] == 0, out
    assert out["duplicate_examples"][0]["event_id"] == ids[2], out
    assert {u["event_id"] for u in out["unknown_examples"]} == {stranger, None}, out
    assert out["ok"] is True


def test_replayed_aggregate_arrives_again_in_order(db, kafka, tmp_path):
    topic = topic_of(db)
    kafka.create_topic(topic, 4)
    publish_all(db, kafka, tmp_path, [row("r", v) for v in range(1, 6)] + [row("s", 1)])
    env = ctl_env(db, kafka)
    # --dry-run changes nothing
    r = outboxctl(env, "replay", "--aggregate", "Order/r", "--from-version", "3", "--dry-run",
                  expect=0)
    assert "would replay 3 row(s) of 1 aggregate(s)" in r.stdout, r.stdout
    assert db.count("status <> 'PUBLISHED'") == 0
    r = outboxctl(env, "replay", "--aggregate", "Order/r", "--from-version", "3", expect=0)
    assert "replayed 3 row(s) of 1 aggregate(s)" in r.stdout, r.stdout
    moved = db.rows(where="status = 'PENDING'", order_by="aggregate_version")
    assert [m["aggregate_version"] for m in moved] == [3, 4, 5]
    assert all(m["published_at"] is None and m["attempt_count"] == 0 for m in moved)
    with Relay("outbox-relay", env=relay_env(db, kafka), log_dir=tmp_path, name="again") as rel:
        wait_until(lambda: db.count("status <> 'PUBLISHED'") == 0, 30, what="replayed")
        assert rel.stop() == 0
    msgs = read_topics(kafka.bootstrap, topics=[topic])
    seen, all_ = first_copies(msgs, "r")
    assert seen == [1, 2, 3, 4, 5] and all_ == [1, 2, 3, 4, 5, 3, 4, 5], all_
    ok, details = check_order(msgs)
    assert ok, details
    out = reconcile(db, kafka)
    assert out["missing"] == 0 and out["reorders"] == 0 and out["duplicates"] == 3, out


def test_replaying_a_middle_range_runs_to_the_latest_version(db, kafka, tmp_path):
    """Versions 1-2 published an hour ago, 3-4 in the window, 5-6 after it:
    replaying the window alone would leave 5 published above the replayed 4
    (the relay sends a late version DEAD, unsent), so the replay runs on to
    6. Nothing is held as a gap, nothing goes DEAD, and Kafka gets 3..6 again
    in order."""
    topic = topic_of(db)
    kafka.create_topic(topic, 4)
    publish_all(db, kafka, tmp_path, [row("mid", v) for v in range(1, 7)] + [row("calm", 1)])
    for lo, hi, ago in ((1, 2, "3 hours"), (3, 4, "2 hours"), (5, 6, "1 hour")):
        db.execute("UPDATE %s SET published_at = now() - interval '%s'"
                   " WHERE aggregate_id = 'mid' AND aggregate_version BETWEEN %d AND %d"
                   % (db.table, ago, lo, hi))
    db.execute("UPDATE %s SET published_at = now() - interval '2 hours'"
               " WHERE aggregate_id = 'calm'" % db.table)
    env = ctl_env(db, kafka)
    r = outboxctl(env, "replay", "--since", "150m", "--until", "90m", expect=0)
    assert "replayed 5 row(s) of 2 aggregate(s)" in r.stdout, r.stdout
    assert "3 selected by the window; 2 later version(s)" in r.stdout, r.stdout
    assert [x["aggregate_version"] for x in db.rows(where="status = 'PENDING'",
                                                    order_by="aggregate_version")] == [1, 3, 4, 5, 6]
    with Relay("outbox-relay", env=relay_env(db, kafka), log_dir=tmp_path, name="again") as rel:
        wait_until(lambda: db.count("status <> 'PUBLISHED'") == 0, 30, what="replayed")
        assert rel.stop() == 0
    assert db.count("status = 'DEAD'") == 0
    msgs = read_topics(kafka.bootstrap, topics=[topic])
    seen, all_ = first_copies(msgs, "mid")
    assert all_ == [1, 2, 3, 4, 5, 6, 3, 4, 5, 6], all_
    assert reconcile(db, kafka)["reorders"] == 0


def test_replay_refuses_what_it_must_not_move(db, kafka, tmp_path):
    topic = topic_of(db)
    kafka.create_topic(topic, 4)
    publish_all(db, kafka, tmp_path, [row("p", 1), row("p", 2), row("busy", 1), row("busy", 2),
                                      row("rel", 1), row("rel", 2), row("kept", 1)])
    # p/3 DEAD and p/4 PENDING: asked for with --aggregate, refused
    db.insert_events([row("p", 3), row("p", 4)])
    db.execute("UPDATE %s SET status = 'DEAD', available_at = 'infinity',"
               " last_error_code = 'INVALID_HEADERS' WHERE aggregate_id = 'p'"
               " AND aggregate_version = 3" % db.table)
    env = ctl_env(db, kafka)
    r = outboxctl(env, "replay", "--aggregate", "Order/p", expect=1)
    assert "replayed 2 row(s)" in r.stdout, r.stdout
    assert "refused 2 row(s) not PUBLISHED (PENDING 1, FAILED 0, DEAD 1" in r.stdout, r.stdout
    db.execute("UPDATE %s SET status = 'PUBLISHED', published_at = now() WHERE aggregate_id = 'p'"
               " AND aggregate_version IN (1, 2)" % db.table)  # back as it was
    # a version being published (PUBLISHING) holds its whole aggregate back
    db.insert_events([row("busy", 3)])
    db.execute("UPDATE %s SET status = 'PUBLISHING', locked_by = 'r9', locked_at = now()"
               " WHERE aggregate_id = 'busy' AND aggregate_version = 3" % db.table)
    r = outboxctl(env, "replay", "--aggregate", "Order/busy", expect=1)
    assert "replayed 0 row(s)" in r.stdout, r.stdout
    assert "refused 2 row(s) of 1 aggregate(s): a version of the aggregate is being published" \
        in r.stdout, r.stdout
    assert db.count("aggregate_id = 'busy' AND status = 'PUBLISHED'") == 2
    # a released gap: never replayed; the versions below it stay, those above go
    db.execute("INSERT INTO %s (aggregate_type, aggregate_id, aggregate_version, event_type,"
               " status, published_at, last_error_code) VALUES ('Order', 'rel', 3,"
               " 'outbox.gap-released', 'PUBLISHED', now(), 'GAP_RELEASED')" % db.table)
    db.insert_events([row("rel", 4)])
    db.execute("UPDATE %s SET status = 'PUBLISHED', published_at = now()"
               " WHERE aggregate_id = 'rel' AND aggregate_version = 4" % db.table)
    r = outboxctl(env, "replay", "--aggregate", "Order/rel", expect=1)
    assert "replayed 1 row(s)" in r.stdout and "refused 2 row(s) below a released gap" \
        in r.stdout and "left 1 GAP_RELEASED record(s)" in r.stdout, r.stdout
    assert db.count("aggregate_id = 'rel' AND status = 'PENDING'") == 1
    # a latest row the sweeper keeps (available_at 'infinity') is replayed, due now
    db.execute("UPDATE %s SET available_at = 'infinity' WHERE aggregate_id = 'kept'" % db.table)
    outboxctl(env, "replay", "--aggregate", "Order/kept", expect=0)
    (kept,) = db.rows(where="aggregate_id = 'kept'")
    assert kept["status"] == "PENDING" and kept["available_at"].year < 3000
    # what was replayed goes out in order
    db.execute("UPDATE %s SET status = 'PUBLISHED', published_at = now(), locked_by = NULL,"
               " locked_at = NULL WHERE status = 'PUBLISHING'" % db.table)
    with Relay("outbox-relay", env=relay_env(db, kafka), log_dir=tmp_path, name="again") as rel:
        wait_until(lambda: db.count("status IN ('PENDING', 'FAILED') AND aggregate_id <> 'p'")
                   == 0, 30, what="replayed rows published (p/4 waits behind DEAD p/3)")
        assert rel.stop() == 0
    assert db.count("status = 'DEAD' AND last_error_code = 'LATE_VERSION'") == 0
    ok, details = check_order(read_topics(kafka.bootstrap, topics=[topic]))
    assert ok, details


@pytest.mark.parametrize("args", [
    ["requeue", "--id", "not-a-uuid"],
    ["requeue"],
    ["requeue", "--id", "6f1c0000-0000-0000-0000-000000000000", "--all-dead"],
    ["requeue", "--aggregate", "no-slash"],
    ["requeue", "--code", "X", "--id", "6f1c0000-0000-0000-0000-000000000000"],
    ["dead", "--limit", "-1"],
    ["dead", "--limit"],
    ["gaps", "--bogus"],
    ["release-gap"],
    ["replay"],
    ["replay", "--aggregate", "Order/x", "--since", "1h"],
    ["replay", "--since", "yesterday"],
    ["replay", "--aggregate", "Order/x", "--topic", "t"],
    ["reconcile", "--since", "1h", "--until", "2h"],
    ["reconcile", "--margin", "5"],
    ["reconcile", "--json=yes"],
    ["requeue", "--all-dead", "--limit", "5"],
    ["migrate", "--limit", "5"],
    ["stats", "--dry-run"],
    ["--version", "stats"],
    ["frobnicate"],
    [],
])
def test_usage_errors_exit_2_with_one_line(db, kafka, args):
    """One plain line (not a log line) saying what is wrong and where the
    usage is, nothing on stdout, exit 2."""
    r = outboxctl(ctl_env(db, kafka), *args, expect=2)
    lines = r.stderr.splitlines()
    assert len(lines) == 1, lines
    commands = ("stats", "dead", "requeue", "gaps", "release-gap", "replay", "reconcile",
                "migrate")
    cmd = args[0] if args and args[0] in commands else None
    assert re.fullmatch(r"outboxctl: .+ \(see outboxctl %s--help\)"
                        % (cmd + " " if cmd else ""), lines[0]), lines
    assert "level=" not in lines[0] and not lines[0].startswith("{"), lines
    assert r.stdout == ""


def test_help_and_settings(db, kafka):
    r = outboxctl({}, "--version", expect=0)
    assert re.fullmatch(r"outboxctl \d+\.\d+\.\d+\n", r.stdout) and r.stderr == "", r
    relay = subprocess.run([bin_path("outbox-relay"), "--version"], stdout=subprocess.PIPE,
                           text=True)
    assert r.stdout.split()[1] == relay.stdout.split()[1], "the daemons' version, their format"
    r = outboxctl({}, "--help", expect=0)
    for word in ("stats", "dead", "requeue", "gaps", "release-gap", "replay", "reconcile",
                 "migrate", "--version", "OUTBOX_DATABASE_URL", "OUTBOX_TOPIC_TEMPLATE"):
        assert word in r.stdout, word
    assert "--from-version" in outboxctl({}, "replay", "--help", expect=0).stdout
    # reconcile needs a broker; the other commands do not
    env = ctl_env(db, kafka)
    del env["OUTBOX_KAFKA_BOOTSTRAP_SERVERS"]
    r = outboxctl(env, "reconcile", expect=2)
    assert "OUTBOX_KAFKA_BOOTSTRAP_SERVERS" in r.stderr and len(r.stderr.splitlines()) == 1
    outboxctl(env, "stats", expect=0)
    r = outboxctl({**env, "OUTBOX_TOPIC_TEMPLATE": "x.{nope}"}, "stats", expect=2)
    assert "OUTBOX_TOPIC_TEMPLATE" in r.stderr
    # a database that cannot be reached is a runtime error, without the password
    r = outboxctl({**env, "OUTBOX_DATABASE_URL":
                   "postgresql://u:SECRET@127.0.0.1:1/x?connect_timeout=2"}, "stats", expect=1)
    assert "SECRET" not in r.stderr and "cannot connect" in r.stderr


def test_topic_template_and_topic_name(db, kafka, tmp_path):
    """Rows with topic_name go to their own topic; --topic narrows the
    comparison to the topics named (rows and messages)."""
    own = "%s.own" % db.schema
    kafka.create_topic(topic_of(db), 2)
    kafka.create_topic(own, 2)
    publish_all(db, kafka, tmp_path, [row("t", 1), row("t", 2, topic_name=own), row("u", 1)])
    out = reconcile(db, kafka)
    assert {t["topic"]: t["rows"] for t in out["topics"]} == {topic_of(db): 2, own: 1}, out
    out = reconcile(db, kafka, "--topic", own)
    assert out["rows"] == 1 and out["messages"] == 1 and out["missing"] == 0, out
    ids = db.insert_events([row("v", 1)])
    db.execute("UPDATE %s SET status = 'PUBLISHED', published_at = now()"
               " WHERE outbox_id = %%s" % db.table, (ids[0],))
    assert reconcile(db, kafka, "--topic", own)["missing"] == 0
    out = reconcile(db, kafka, "--topic", "%s.missing" % db.schema)
    assert out["rows"] == 0 and out["topics"][0]["on_kafka"] is False, out
    # replay selects by topic the same way: t/2 only (the latest version of t)
    r = outboxctl(ctl_env(db, kafka), "replay", "--since", "1h", "--topic", own, "--dry-run",
                  expect=0)
    assert "would replay 1 row(s) of 1 aggregate(s)" in r.stdout, r.stdout
    assert "Order/t" in r.stdout and db.count("status <> 'PUBLISHED'") == 0


def test_connection_string_forms(db, kafka):
    # a keyword/value string with the password in it: connects, never shown
    u = psycopg2.extensions.parse_dsn(db.pg.url)
    kw = "host=%s port=%s dbname=%s user=%s password=%s" % (
        u["host"], u["port"], u["dbname"], u["user"], u.get("password", "x"))
    r = outboxctl({**ctl_env(db, kafka), "OUTBOX_DATABASE_URL": kw}, "stats", expect=0)
    assert "PENDING" in r.stdout


def test_replay_while_relays_publish_and_new_versions_commit(db, kafka, tmp_path):
    """Replays of a hot aggregate while two relays run and the application
    commits its next versions: a lock statement that began before a replay
    committed must not publish a newer version ahead of the replayed ones
    (they would go DEAD as LATE_VERSION), and Kafka's first copies stay in
    order. Lock statements pause 50 ms inside (test hook, where built) to
    widen that window."""
    import threading
    import time
    topic = topic_of(db)
    kafka.create_topic(topic, 1)
    publish_all(db, kafka, tmp_path, [row("hot", v) for v in range(1, 11)])
    stop = threading.Event()
    inserted = [10]

    def writer():
        conn = db.pg.connect()
        try:
            while not stop.is_set():
                v = inserted[0] + 1
                with conn.cursor() as cur:
                    cur.execute("INSERT INTO %s (aggregate_type, aggregate_id, aggregate_version,"
                                " event_type, payload_json) VALUES ('Order', 'hot', %%s, 'E', '{}')"
                                % db.table, (v,))
                inserted[0] = v
                time.sleep(0.01)
        finally:
            conn.close()

    env = relay_env(db, kafka, OUTBOX_TEST_LOCK_DELAY_MS=50, OUTBOX_BATCH_SIZE=5)
    relays = [Relay("outbox-relay", env={**env, "OUTBOX_RELAY_ID": "r%d" % i}, log_dir=tmp_path,
                    name="r%d" % i) for i in range(2)]
    t = threading.Thread(target=writer)
    t.start()
    replays = moved = 0
    try:
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            top = db.execute("SELECT coalesce(max(aggregate_version), 1) AS v FROM %s WHERE"
                             " status = 'PUBLISHED'" % db.table)[0]["v"]
            r = outboxctl(ctl_env(db, kafka), "replay", "--aggregate", "Order/hot",
                          "--from-version", max(1, top - 3))
            assert r.returncode in (0, 1), (r.stdout, r.stderr)
            m = re.search(r"replayed (\d+) row", r.stdout)
            moved += int(m.group(1)) if m else 0
            replays += 1
            time.sleep(0.05)
    finally:
        stop.set()
        t.join()
    try:
        wait_until(lambda: db.count("status <> 'PUBLISHED'") == 0, 60, what="all PUBLISHED")
    except AssertionError as e:
        left = db.execute("SELECT aggregate_version AS v, status, available_at, locked_by"
                          " FROM %s WHERE status <> 'PUBLISHED'"
                          " ORDER BY available_at, aggregate_version LIMIT 12" % db.table)
        left = [(x["v"], x["status"], str(x["available_at"]), x["locked_by"]) for x in left]
        below = db.execute("SELECT aggregate_version AS v, status, available_at, locked_by"
                           " FROM %s WHERE aggregate_version < %%s"
                           " ORDER BY aggregate_version DESC LIMIT 3" % db.table, (left[0][0],))
        left += [(x["v"], x["status"], str(x["available_at"]), x["locked_by"]) for x in below]
        raise AssertionError("%s; first rows left: %r" % (e, left)) from None
    finally:
        for rel in relays:
            assert rel.stop() == 0
    assert moved > 0, "no replay moved a row"
    dead = db.rows(where="status = 'DEAD'")
    assert not dead, [(d["aggregate_version"], d["last_error_message"]) for d in dead]
    msgs = read_topics(kafka.bootstrap, topics=[topic])
    ok, details = check_order(msgs)
    assert ok, details[:5]
    seen, _ = first_copies(msgs, "hot")
    assert seen == list(range(1, inserted[0] + 1))
    out = reconcile(db, kafka)
    assert out["missing"] == 0 and out["reorders"] == 0, out
    print("%d replays moved %d rows; %d versions; %d messages"
          % (replays, moved, inserted[0], len(msgs)))


PAUSED = ("SELECT count(*) AS n FROM pg_stat_activity WHERE wait_event = 'PgSleep'"
          " AND query LIKE '/* relay: lock%%' AND query LIKE %s")


def test_replay_while_a_lock_statement_that_began_before_it_runs(db, kafka, tmp_path):
    """A lock statement begins (its snapshot: versions 1-5 published, 6
    committed and due), then a replay of 3.. runs to its end before the
    statement locks rows. The statement must not take version 6 ahead of the
    replayed 3-5 (they would go DEAD as LATE_VERSION): the replay gave 6 a new
    row version, which the statement cannot see, so it passes 6 by. Kafka gets
    3, 4, 5, 6 in order. The relay's lock statements pause 3 s before their
    row locks (test hook OUTBOX_TEST_LOCK_DELAY_MS; skipped without hooks)."""
    if "OUTBOX_TEST_REPLAY_PAUSE_MS" not in outboxctl({}, "--help").stdout:
        pytest.skip("needs -DOUTBOX_TEST_HOOKS=ON")
    topic = topic_of(db)
    kafka.create_topic(topic, 1)
    db.insert_events([row("old", v) for v in range(1, 6)])
    db.execute("UPDATE %s SET status = 'PUBLISHED', published_at = now()" % db.table)
    db.insert_events([row("old", 6)])
    env = relay_env(db, kafka, OUTBOX_TEST_LOCK_DELAY_MS=3000)
    with Relay("outbox-relay", env=env, log_dir=tmp_path) as relay:
        wait_until(lambda: db.execute(PAUSED, ("%%%s%%" % db.schema,))[0]["n"] > 0, 30,
                   what="a lock statement paused before its row locks")
        # exit 1: version 6, asked for but not PUBLISHED, is refused (left as it is)
        r = outboxctl(ctl_env(db, kafka), "replay", "--aggregate", "Order/old",
                      "--from-version", "3", expect=1)
        assert "replayed 3 row(s) of 1 aggregate(s)" in r.stdout, r.stdout
        assert "refused 1 row(s) not PUBLISHED (PENDING 1" in r.stdout, r.stdout
        # the paused statement is still before its row locks
        assert db.execute(PAUSED, ("%%%s%%" % db.schema,))[0]["n"] > 0, "replay too slow"
        wait_until(lambda: db.count("status NOT IN ('PUBLISHED', 'DEAD')") == 0, 60,
                   what="all PUBLISHED or DEAD")
        assert relay.stop() == 0
    dead = db.rows(where="status = 'DEAD'")
    assert not dead, [(d["aggregate_version"], d["last_error_message"]) for d in dead]
    seen, all_ = first_copies(read_topics(kafka.bootstrap, topics=[topic]), "old")
    assert all_ == [3, 4, 5, 6], all_
