"""outboxctl reconcile against brokers that cannot look offsets up by time,
and partitions it cannot read (docs/DESIGN.md, "Reconciling with Kafka"):

  - librdkafka's mock cluster (the demo's broker) answers offsets-for-times
    with -1: reconcile scans those partitions from their start, keeps the
    messages whose timestamps fall in the window (older copies are left out),
    and reports what it read: missing 0, exit 0; a row marked PUBLISHED by
    hand is still missing (exit 1);
  - Apache Kafka looks offsets up by time: no partition is scanned, the same
    counts;
  - a partition whose leader is down cannot be read: reconcile never calls
    the rows it could not find "missing": missing is null, not_found counts
    them, the partitions are named, exit 3 (cannot tell).
Messages of the tests' own (an old copy, an old stranger) are produced with
confluent_kafka with explicit timestamps."""
import json
import os
import subprocess
import time
import types
import uuid

from confluent_kafka import Consumer, Producer, TopicPartition

from conftest import relay_env
from harness import MockBroker, Relay, bin_path, wait_until

OUTBOXCTL = bin_path("outboxctl")
HOUR_MS = 3600 * 1000


def reconcile(db, bootstrap, *args, expect=None):
    base = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env = {"OUTBOX_DATABASE_URL": db.pg.url, "OUTBOX_TABLE": db.table,
           "OUTBOX_TOPIC_TEMPLATE": "%s.{aggregate_type}" % db.schema,
           "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": bootstrap}
    r = subprocess.run([OUTBOXCTL, "reconcile", "--json", *args], env={**base, **env},
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=180)
    if expect is not None:
        assert r.returncode == expect, (r.returncode, r.stdout[:2000], r.stderr[-2000:])
    return r.returncode, (json.loads(r.stdout) if r.stdout.strip() else None), r.stderr


def rows(n, prefix="a"):
    return [{"aggregate_type": "Order", "aggregate_id": "%s%d" % (prefix, i % 7),
             "aggregate_version": i // 7 + 1, "event_type": "E", "payload_json": {"i": i}}
            for i in range(n)]


def publish(db, bootstrap, tmp_path, n, name="relay"):
    ids = db.insert_events(rows(n))
    env = relay_env(db, types.SimpleNamespace(bootstrap=bootstrap))
    with Relay("outbox-relay", env=env, log_dir=tmp_path, name=name) as relay:
        wait_until(lambda: db.count("status <> 'PUBLISHED'") == 0, 60, what="all PUBLISHED")
        assert relay.stop() == 0
    return ids


def produce_old(bootstrap, topic, event_ids, partition=0, age_ms=2 * HOUR_MS):
    """Messages with CreateTime `age_ms` ago (before any window the tests ask
    for): copies of rows, or strangers."""
    p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    ts = int(time.time() * 1000) - age_ms
    for eid in event_ids:
        p.produce(topic, key=b"old", value=b"{}", partition=partition, timestamp=ts,
                  headers=[("event-id", eid)])
    assert p.flush(30) == 0


def publish_by_hand(db):
    """A PUBLISHED row that never reached Kafka."""
    (oid,) = db.insert_events([{"aggregate_type": "Order", "aggregate_id": "hand",
                                "aggregate_version": 1, "event_type": "E",
                                "payload_json": {}}])
    db.execute("UPDATE %s SET status = 'PUBLISHED', published_at = now() WHERE outbox_id = %%s"
               % db.table, (oid,))
    return oid


def test_mock_cluster_partitions_are_scanned_from_their_start(db, tmp_path, report):
    with MockBroker(["-b", "1"], log_dir=str(tmp_path)) as mock:
        topic = "%s.Order" % db.schema
        mock.create_topic(topic, 3)
        ids = publish(db, mock.bootstrap, tmp_path, 70)
        # an old copy of a row and an old stranger: outside the window, not read
        produce_old(mock.bootstrap, topic, [ids[0], str(uuid.uuid4())])
        _, out, _ = reconcile(db, mock.bootstrap, expect=0)
        assert out["rows"] == 70 and out["messages"] == 70, out
        assert out["missing"] == 0 and out["not_found"] == 0 and out["cannot_tell"] is False, out
        assert out["unknown"] == 0 and out["duplicates"] == 0, out  # the old ones left out
        assert sorted(p["partition"] for p in out["scanned_partitions"]) == [0, 1, 2], out
        assert out["unread_partitions"] == [] and out["ok"] is True, out
        # a genuinely missing row is still found missing
        lost = publish_by_hand(db)
        _, out, _ = reconcile(db, mock.bootstrap, expect=1)
        assert out["missing"] == 1 and out["missing_ids"] == [lost], out
    report("mock cluster: 3 partitions scanned from their start, 70 rows / 70 messages in"
           " the window (2 older messages left out), missing 0; a row published by hand:"
           " missing 1, exit 1")


def test_apache_kafka_looks_offsets_up_by_time(db, kafka, tmp_path, report):
    topic = "%s.Order" % db.schema
    kafka.create_topic(topic, 3)
    produce_old(kafka.bootstrap, topic, [str(uuid.uuid4())])
    ids = publish(db, kafka.bootstrap, tmp_path, 70)
    produce_old(kafka.bootstrap, topic, [ids[1]], partition=1)
    _, out, _ = reconcile(db, kafka.bootstrap, expect=0)
    assert out["rows"] == 70 and out["messages"] == 70, out
    assert out["missing"] == 0 and out["unknown"] == 0 and out["duplicates"] == 0, out
    assert out["scanned_partitions"] == [] and out["unread_partitions"] == [], out
    report("Apache Kafka: offsets looked up by time, no partition scanned, 70/70, missing 0")


def leader_of_a_partition_with_messages(bootstrap, topic):
    """The broker id leading a partition of `topic` that holds messages (the
    mock cluster picks leaders at random: both partitions may share one)."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "leader-probe",
                  "enable.auto.commit": False})
    try:
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        for p in sorted(parts):
            lo, hi = c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            if hi > lo:
                return parts[p].leader
    finally:
        c.close()
    raise AssertionError("no partition of %s holds a message" % topic)


def test_partition_that_cannot_be_read_is_cannot_tell_not_missing(db, tmp_path, report):
    with MockBroker(["-b", "2"], log_dir=str(tmp_path)) as mock:
        topic = "%s.Order" % db.schema
        mock.create_topic(topic, 2)
        publish(db, mock.bootstrap, tmp_path, 40)
        victim = leader_of_a_partition_with_messages(mock.bootstrap, topic)
        mock.down(victim)
        try:
            code, out, err = reconcile(db, mock.bootstrap)
        finally:
            mock.up(victim)
    assert code == 3, (code, out, err[-2000:])
    assert out["missing"] is None and out["cannot_tell"] is True and out["ok"] is False, out
    unread = out["unread_partitions"]
    assert unread and all(p["topic"] == topic and p["reason"] for p in unread), out
    assert out["not_found"] + out["messages"] >= 40 and out["not_found"] > 0, out
    assert "partition not read" in err, err[-2000:]
    report("broker %d down: exit 3, missing null, %d row(s) not found, unread: %s",
           victim, out["not_found"], ["%s[%d]: %s" % (p["topic"], p["partition"], p["reason"])
                              for p in unread])
