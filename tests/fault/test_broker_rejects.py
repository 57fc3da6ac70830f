"""Rejections only a real broker gives (G1, G4).

Broker: an Apache Kafka node of this module's own, started with
auto.create.topics.enable=false (as production clusters usually run), since
tests/run's broker creates topics on first use.

  - A topic whose max.message.bytes is below the producer's message.max.bytes:
    librdkafka sends the message and the broker refuses it
    (MSG_SIZE_TOO_LARGE). The row goes DEAD on its first attempt, the later
    versions of its aggregate wait, every other aggregate flows.
  - A topic that does not exist: rows go FAILED with UNKNOWN_TOPIC_OR_PART
    (the broker's answer) or _UNKNOWN_TOPIC (librdkafka's, for a topic it
    already knows is missing), are retried with backoff, never DEAD, and are
    published once the topic is created; rows of other topics flow meanwhile.
    librdkafka waits topic.metadata.propagation.max.ms (30 s by default)
    before it believes a topic missing; with a shorter delivery.timeout.ms
    the row's code is _MSG_TIMED_OUT instead. The test sets 1 s.
"""
import base64
import collections
import os

import pytest

from conftest import check_audit, check_kafka, relay_env, wait_quiet
from harness import KafkaCluster, Relay, header, make_events, wait_until

TOPIC_MAX_BYTES = 100_000


@pytest.fixture(scope="module")
def broker():
    with KafkaCluster(settings={"auto.create.topics.enable": "false"}) as k:
        yield k


def row(agg, v, **kw):
    r = {"aggregate_type": "Order", "aggregate_id": agg, "aggregate_version": v,
         "event_type": "E", "payload_json": {"agg": agg, "v": v}}
    r.update(kw)
    return r


def test_message_over_the_topics_max_message_bytes_goes_dead(db, broker, tmp_path, report):
    topic = "%s.Order" % db.schema
    broker.create_topic(topic, 2, config={"max.message.bytes": TOPIC_MAX_BYTES})
    # Random bytes in base64: zstd cannot shrink it below the topic's limit,
    # and it is far below librdkafka's own message.max.bytes (1000000).
    pad = base64.b64encode(os.urandom(3 * TOPIC_MAX_BYTES)).decode()
    healthy = make_events(aggregates=40, versions=3, id_prefix="ok")
    db.insert_events([row("big", 1, payload_json={"pad": pad}), row("big", 2), row("big", 3)]
                     + healthy)
    with Relay("outbox-relay", name="r-size", log_dir=tmp_path,
               env=relay_env(db, broker, "r-size")) as relay:
        wait_until(lambda: db.count("status = 'DEAD'") == 1 and
                   db.count("status = 'PUBLISHED'") == len(healthy), 60,
                   what="big/1 DEAD, the other aggregates PUBLISHED")
        more = make_events(aggregates=40, versions=5, id_prefix="ok")[len(healthy):]
        db.insert_events(more)
        wait_until(lambda: db.count("status = 'PUBLISHED'") == len(healthy) + len(more), 60,
                   what="rows inserted after the rejection PUBLISHED")
        assert relay.stop() == 0
        log = relay.log_text()
    (dead,) = db.rows(where="status = 'DEAD'")
    assert (dead["aggregate_id"], dead["aggregate_version"]) == ("big", 1)
    assert dead["last_error_code"] == "MSG_SIZE_TOO_LARGE", dead
    assert dead["attempt_count"] == 1, "a permanent error is not retried"
    held = db.rows(where="aggregate_id = 'big' AND aggregate_version > 1")
    assert [(r["status"], r["attempt_count"]) for r in held] == [("PENDING", 0)] * 2, held
    others = db.rows(where="aggregate_id <> 'big'")
    assert all(r["status"] == "PUBLISHED" and r["attempt_count"] == 1 for r in others), \
        [(r["aggregate_id"], r["aggregate_version"], r["status"], r["last_error_code"])
         for r in others if r["status"] != "PUBLISHED" or r["attempt_count"] != 1][:5]
    assert pad[:1000] not in log, "payload in the log"
    audit = check_audit(db)
    assert not audit.violations, audit.violations[:10]
    kc, problems = check_kafka(broker, [topic], db.rows(), dup_allowed=set())
    assert not problems, problems
    assert not [m for m in kc.msgs if m["key"] == "big"]
    assert len(kc.ids) == len(others)
    report("topic max.message.bytes %d: big/1 (%d bytes of payload) DEAD %s on attempt 1, "
           "big/2-3 PENDING; %d rows of 40 other aggregates PUBLISHED, each on its first "
           "attempt (incl. %d inserted afterwards); kafka: %d messages, none of big",
           TOPIC_MAX_BYTES, len(pad), dead["last_error_code"], len(others), len(more),
           len(kc.msgs))


def test_missing_topic_rows_wait_until_it_exists(db, broker, tmp_path, report):
    present = "%s.Order" % db.schema
    missing = "%s.Invoice" % db.schema
    broker.create_topic(present, 2)
    rows = make_events(aggregates=5, versions=2, aggregate_type="Invoice", id_prefix="inv")
    db.insert_events(rows)
    env = relay_env(db, broker, "r-topic", OUTBOX_MAX_ATTEMPTS=1000,
                    OUTBOX_BACKOFF_INITIAL_MS=500, OUTBOX_BACKOFF_MAX_MS=2000,
                    OUTBOX_KAFKA_TOPIC_METADATA_PROPAGATION_MAX_MS=1000)
    with Relay("outbox-relay", name="r-topic", log_dir=tmp_path, env=env) as relay:
        wait_until(lambda: [a for a in check_audit(db).failed if a["attempt_count"] >= 2], 60,
                   interval=0.5, what="rows for the missing topic FAILED twice")
        flowing = make_events(aggregates=10, versions=2, id_prefix="ord")
        db.insert_events(flowing)
        wait_until(lambda: db.count("status = 'PUBLISHED'") == len(flowing), 30,
                   what="rows of an existing topic PUBLISHED meanwhile")
        assert db.count("status = 'DEAD'") == 0
        assert db.count("aggregate_type = 'Invoice' AND status = 'PUBLISHED'") == 0
        broker.create_topic(missing, 2)
        counts = wait_quiet(db, 60, "the Invoice rows PUBLISHED once the topic exists")
        assert relay.stop() == 0
    assert counts["PUBLISHED"] == len(rows) + len(flowing), counts
    audit = check_audit(db)
    assert not audit.violations, audit.violations[:10]
    codes = collections.Counter(a["code"] for a in audit.failed)
    unknown = {"UNKNOWN_TOPIC_OR_PART", "_UNKNOWN_TOPIC"}
    # _MSG_TIMED_OUT: a batch whose metadata answer came after its delivery timeout
    assert set(codes) & unknown and set(codes) <= unknown | {"_MSG_TIMED_OUT"}, codes
    for a in audit.failed:
        assert a["available_at"] > a["ts"], ("no backoff", a)
    table = db.rows()
    retried = {oid for oid, n in audit.locks.items() if n > 1}
    kc, problems = check_kafka(broker, [present, missing], table, dup_allowed=retried)
    assert not problems, problems
    assert len(kc.ids) == len(table)
    versions = collections.defaultdict(list)
    for m in kc.msgs:
        if m["topic"] == missing:
            versions[m["key"]].append(int(header(m, "aggregate-version")))
    report("auto-creation off, topic %s missing: its rows FAILED (codes %s), retried with "
           "backoff up to attempt %d, never DEAD; %d rows of an existing topic PUBLISHED "
           "meanwhile; all published once it was created, versions in order %s",
           missing.split(".")[-1], dict(codes), max(r["attempt_count"] for r in table),
           len(flowing), dict(versions))
