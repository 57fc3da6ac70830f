"""G1 and G2 on a 3-broker Apache Kafka cluster while brokers fail.

Broker: a cluster of this module's own (deploy/local/kafka: brokers 1-3 and a
dedicated KRaft controller, node 0, as production runs it, so brokers can go
down without the metadata quorum). Topics have replication factor 3 and
min.insync.replicas=2; the relay runs with its defaults, acks=all and
idempotence. In every test a writer commits events continuously, a broker
fault happens mid-stream, and afterwards every row must be PUBLISHED and on
Kafka (G1) with the first copies in version order per aggregate (G2);
duplicates are printed. A broker failure may cause them two ways (G3 in
docs/DESIGN.md): the relay tries a row again (its delivery report was lost
with a broker: the audit shows a second lock), or the idempotent producer
itself writes a message again after it bumped its epoch (librdkafka does so
once messages timed out or a sequence had a gap, and re-sends under new
sequence numbers what it had not seen acknowledged). The report counts each.

  - SIGKILL the leader of the busiest partition, later restart it;
  - SIGSTOP one broker for longer than the producer's request.timeout.ms;
  - two brokers down: min.insync.replicas cannot be met, rows go FAILED with
    NOT_ENOUGH_REPLICAS* and back off, never DEAD, and publish once the
    brokers return;
  - a rolling restart of all three brokers.
"""
import collections
import time

import pytest

from conftest import Writer, check_audit, check_kafka, relay_env, wait_quiet
from harness import KafkaCluster, Relay, kafka_admin, wait_until

BROKERS = (1, 2, 3)
PARTITIONS = 6
# The relay's request timeout (librdkafka request.timeout.ms) in this module;
# the SIGSTOP lasts longer.
REQUEST_TIMEOUT_MS = 2000
DELIVERY_TIMEOUT_MS = 5000
# What else a row may fail with while brokers shut down (all retriable).
RETRIABLE_ON_SHUTDOWN = {"_MSG_TIMED_OUT", "_TRANSPORT", "NOT_LEADER_FOR_PARTITION",
                         "LEADER_NOT_AVAILABLE", "REQUEST_TIMED_OUT", "_PURGE_INFLIGHT",
                         "_PURGE_QUEUE"}


@pytest.fixture(scope="module")
def cluster():
    with KafkaCluster(nodes=3, controller=True) as c:
        yield c


@pytest.fixture(autouse=True)
def every_broker_back(cluster):
    """Each test starts, and leaves, with the three brokers running."""
    yield
    for n in BROKERS:
        try:
            cluster.resume(n)
        except OSError:
            pass
        if not cluster.node_running(n):
            cluster.start_node(n)
    cluster.wait_brokers(3, timeout=60)


def published(db):
    return db.count("status = 'PUBLISHED'")


def busiest_leader(cluster, topic):
    """(partition, leader) of the partition with the most messages."""
    ends = kafka_admin.end_offsets(cluster.bootstrap, topic)
    part = max(ends, key=ends.get)
    return part, cluster.leaders(topic)[part][0]


def wait_full_isr(cluster, topic, timeout=60):
    wait_until(lambda: all(lead in BROKERS and len(isr) == 3
                           for lead, isr in cluster.leaders(topic).values()), timeout,
               interval=0.2, what="every partition of %s with a leader and 3 in sync" % topic)


def start(db, cluster, name, **extra):
    topic = "%s.Order" % db.schema
    cluster.create_topic(topic, PARTITIONS, 3, {"min.insync.replicas": 2})
    env = relay_env(db, cluster, name, OUTBOX_MAX_ATTEMPTS=1000,
                    OUTBOX_KAFKA_DELIVERY_TIMEOUT_MS=DELIVERY_TIMEOUT_MS,
                    OUTBOX_KAFKA_REQUEST_TIMEOUT_MS=REQUEST_TIMEOUT_MS, **extra)
    return topic, env


def progress(db, writer, more, timeout, what):
    """Waits until `more` rows beyond those PUBLISHED now are PUBLISHED, while
    the writer keeps writing."""
    target = published(db) + more
    wait_until(lambda: published(db) >= target, timeout, interval=0.1, what=what)


def finish(db, cluster, topic, writer, relay, report, what, **facts):
    """Stops the writer, waits for every row, stops the relay and checks G1
    and G2 on Kafka; returns (KafkaCheck, Audit)."""
    total = writer.stop()
    counts = wait_quiet(db, 120, "every row final after %s" % what)
    assert relay.stop() == 0, relay.log_text()[-3000:]
    assert counts["PUBLISHED"] == total, (counts, total)
    assert counts["DEAD"] == 0
    table = db.rows()
    audit = check_audit(db)
    assert not audit.violations, audit.violations[:10]
    retried = {oid for oid, n in audit.locks.items() if n > 1}
    kc, problems = check_kafka(cluster, [topic], table,
                               dup_allowed={r["outbox_id"] for r in table})
    assert not problems, problems
    resent = set(kc.dups) - retried  # the producer's own, locked once
    assert len(kc.ids) == total
    codes = collections.Counter(a["code"] for a in audit.failed)
    report("%s: %d events by a writer committing meanwhile, all PUBLISHED and on Kafka; "
           "order ok in %d partitions; %d duplicate copies of %d events %s (%d of them "
           "locked once: the producer's re-sends); FAILED marks by code %s; %s", what, total,
           len({m["partition"] for m in kc.msgs}), kc.extra_copies, len(kc.dups),
           sorted(kc.dups)[:5], len(resent), dict(codes),
           ", ".join("%s %s" % kv for kv in facts.items()))
    return kc, audit


def test_leader_of_the_busiest_partition_killed(db, cluster, tmp_path, report):
    topic, env = start(db, cluster, "r-lead")
    writer = Writer(db, "k")
    with Relay("outbox-relay", name="r-lead", log_dir=tmp_path, env=env) as relay:
        writer.start()
        progress(db, writer, 500, 60, "500 rows published before the kill")
        part, leader = busiest_leader(cluster, topic)
        t0 = time.monotonic()
        cluster.kill(leader)
        wait_until(lambda: cluster.leaders(topic)[part][0] not in (leader, -1), 30,
                   interval=0.1, what="a new leader for partition %d" % part)
        moved_s = time.monotonic() - t0
        progress(db, writer, 500, 60, "500 rows published with broker %d dead" % leader)
        cluster.start_node(leader)
        wait_full_isr(cluster, topic)
        progress(db, writer, 200, 60, "rows published after the restart")
        finish(db, cluster, topic, writer, relay, report,
               "SIGKILL of broker %d, leader of the busiest partition %d" % (leader, part),
               leader_moved_after_s="%.1f" % moved_s)


def test_broker_stopped_longer_than_the_request_timeout(db, cluster, tmp_path, report):
    topic, env = start(db, cluster, "r-stop")
    writer = Writer(db, "s")
    with Relay("outbox-relay", name="r-stop", log_dir=tmp_path, env=env) as relay:
        writer.start()
        progress(db, writer, 500, 60, "500 rows published before the SIGSTOP")
        _, victim = busiest_leader(cluster, topic)
        stop_s = 2.5 * REQUEST_TIMEOUT_MS / 1000
        with cluster.paused(victim):
            before = published(db)
            time.sleep(stop_s)  # the length of the hang is the variable under test
            during = published(db) - before
        wait_full_isr(cluster, topic)
        progress(db, writer, 500, 60, "rows published after SIGCONT")
        finish(db, cluster, topic, writer, relay, report,
               "broker %d stopped %.1fs (request.timeout.ms %d)"
               % (victim, stop_s, REQUEST_TIMEOUT_MS), published_while_stopped=during)


# librdkafka retries a NOT_ENOUGH_REPLICAS answer itself, without limit by
# default, so the row's error is the delivery timeout's (_MSG_TIMED_OUT); with
# a retry limit (librdkafka `retries`) the broker's own code reaches the row.
@pytest.mark.parametrize("retries,codes", [(None, {"_MSG_TIMED_OUT"}),
                                           (3, {"NOT_ENOUGH_REPLICAS",
                                                "NOT_ENOUGH_REPLICAS_AFTER_APPEND"})],
                         ids=["default-retries", "retries-3"])
def test_two_brokers_down_rows_wait_then_publish(db, cluster, tmp_path, report, retries, codes):
    extra = {"OUTBOX_BACKOFF_INITIAL_MS": 500, "OUTBOX_BACKOFF_MAX_MS": 2000}
    if retries is not None:
        extra["OUTBOX_KAFKA_RETRIES"] = retries
    topic, env = start(db, cluster, "r-isr", **extra)
    writer = Writer(db, "m")
    seen = lambda: {a["code"] for a in check_audit(db).failed}  # noqa: E731
    with Relay("outbox-relay", name="r-isr", log_dir=tmp_path, env=env) as relay:
        writer.start()
        progress(db, writer, 300, 60, "300 rows published before the brokers go")
        down = BROKERS[1:]
        for n in down:
            cluster.stop_node(n)
        down_at = time.monotonic()
        wait_until(lambda: all(isr == [BROKERS[0]] for _, isr in cluster.leaders(topic).values()),
                   30, interval=0.2, what="ISR shrunk to broker %d" % BROKERS[0])
        wait_until(lambda: seen() & codes, DELIVERY_TIMEOUT_MS / 1000 + 20, interval=0.5,
                   what="rows FAILED with %s" % sorted(codes))
        stuck = published(db)
        time.sleep(2)  # an outage long enough for several backoffs
        assert published(db) == stuck, "published with min.insync.replicas unmet?"
        assert db.count("status = 'DEAD'") == 0
        for n in down:
            cluster.start_node(n)
        up_at = time.monotonic()
        wait_full_isr(cluster, topic)
        progress(db, writer, 300, 90, "rows published after the brokers returned")
        kc, audit = finish(db, cluster, topic, writer, relay, report,
                           "brokers %s stopped (min.insync.replicas 2 unmet), librdkafka "
                           "retries %s" % (down, retries or "unlimited"),
                           outage_s="%.1f" % (up_at - down_at))
    marks = audit.failed
    assert marks, "no row FAILED during the outage"
    for a in marks:
        assert a["available_at"] > a["ts"], ("no backoff", a)
    # Connections the stopping brokers closed may add other retriable codes.
    seen = {a["code"] for a in marks}
    assert seen & codes and seen <= codes | RETRIABLE_ON_SHUTDOWN, seen


def test_rolling_restart_under_load(db, cluster, tmp_path, report):
    topic, env = start(db, cluster, "r-roll")
    writer = Writer(db, "r")
    restarts = []
    with Relay("outbox-relay", name="r-roll", log_dir=tmp_path, env=env) as relay:
        writer.start()
        progress(db, writer, 300, 60, "300 rows published before the restarts")
        for n in BROKERS:
            t0 = time.monotonic()
            cluster.stop_node(n)
            progress(db, writer, 100, 60, "rows published with broker %d stopped" % n)
            cluster.start_node(n)
            wait_full_isr(cluster, topic)
            restarts.append("%d:%.1fs" % (n, time.monotonic() - t0))
        progress(db, writer, 200, 60, "rows published after the rolling restart")
        finish(db, cluster, topic, writer, relay, report,
               "rolling restart of brokers 1, 2, 3", restarts=restarts)
