"""A long aggregate does not starve the others (G1, G2 and a time bound).

Broker: librdkafka's mock cluster (own_kafka), for its per-broker round-trip
time: every broker answers 5 ms late, a broker a little way off. Apache Kafka
on this machine answers in well under a millisecond.

3000 versions of one aggregate are published, then an operator replays them all
(`outboxctl replay --aggregate Order/long0`: back to PENDING, due now), and as
soon as the replay's first copy is on Kafka a writer commits new events of 50
other aggregates, 100 a second, until the long aggregate is on Kafka again. A
consumer tails the topic from the offsets it had before the replay and notes
when each event arrives. Asserted:

  - each new event of another aggregate arrives within 2 s of its COMMIT;
  - the replay sends all 3000 versions again, in version order (G2 on the
    copies after the replay began, not only on first copies);
  - every row ends PUBLISHED and on Kafka (G1), first copies in version order
    per aggregate (G2);
  - the audit (conftest.check_audit): the replay's hold of the published rows
    (the operator's, under locked_by 'outboxctl replay') is the only change of
    a PUBLISHED row, and no relay locks a row while another holds it.
"""
import os
import subprocess
import threading
import time

from confluent_kafka import Consumer, TopicPartition

from conftest import Writer, actor_url, check_audit, check_kafka, relay_env, wait_quiet
from harness import Relay, bin_path, header, kafka_admin, make_events, wait_until

PARTITIONS = 6
VERSIONS = 3000
RTT_MS = 5
BOUND_S = 2.0
LONG = "long0"  # make_events(1, ..., id_prefix="long")


class Tail(threading.Thread):
    """Reads every partition of `topic` from the offsets `starts`
    ({partition: offset}, known before anything the test times is produced:
    a consumer told to start at the end finds the end only once connected,
    and would miss what came before); .arrived maps each event id to the
    wall-clock time its first copy was received."""

    def __init__(self, bootstrap, topic, starts):
        super().__init__(daemon=True)
        self.arrived = {}
        self.error = None
        self._halt = threading.Event()
        self.consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "tail",
                                  "enable.auto.commit": False, "fetch.wait.max.ms": 5,
                                  "fetch.error.backoff.ms": 5, "log_level": 0})
        self.consumer.assign([TopicPartition(topic, p, o) for p, o in starts.items()])

    def run(self):
        try:
            while not self._halt.is_set():
                for m in self.consumer.consume(1000, timeout=0.05):
                    now = time.time()
                    if m.error():
                        continue
                    eid = dict(m.headers() or []).get("event-id")
                    if eid is not None:
                        self.arrived.setdefault(eid.decode(), now)
        except Exception as e:  # reported by stop()
            self.error = e

    def stop(self):
        self._halt.set()
        self.join(10)
        self.consumer.close()
        assert self.error is None, "tail consumer failed: %r" % self.error


def log_starts(bootstrap, topic):
    """{partition: low watermark} of topic."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "log-starts", "log_level": 0})
    try:
        return {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[0]
                for p in range(PARTITIONS)}
    finally:
        c.close()


def outboxctl(db, *args):
    env = {**os.environ, "OUTBOX_DATABASE_URL": actor_url(db.pg.url, "operator"),
           "OUTBOX_TABLE": db.table}
    r = subprocess.run([bin_path("outboxctl"), *args], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, (args, r.returncode, r.stdout, r.stderr)
    return r.stdout


def long_published(db):
    return db.count("aggregate_id = %s AND status = 'PUBLISHED'", (LONG,))


def test_long_aggregate_does_not_starve_the_others(db, own_kafka, tmp_path, report):
    topic = "%s.Order" % db.schema
    own_kafka.create_topic(topic, PARTITIONS)
    db.insert_events(make_events(1, VERSIONS, id_prefix="long"))
    env = relay_env(db, own_kafka, "r-long")
    with Relay("outbox-relay", name="r-long", log_dir=tmp_path, env=env) as relay:
        wait_until(lambda: long_published(db) == VERSIONS, 180, interval=0.2,
                   what="%d versions of %s PUBLISHED" % (VERSIONS, LONG))
        own_kafka.set_rtt(RTT_MS)
        ends = kafka_admin.end_offsets(own_kafka.bootstrap, topic)
        assert len(ends) == PARTITIONS, ends
        tail = Tail(own_kafka.bootstrap, topic, ends)
        tail.start()
        writer = Writer(db, "o", aggregates=50, per_tx=5, period=0.05)
        replay_at = time.time()
        out = outboxctl(db, "replay", "--aggregate", "Order/%s" % LONG)
        assert "replayed %d row(s)" % VERSIONS in out, out
        # the tail consumer's own start-up is not the relay's latency: the
        # writer starts once the tail has the replay's first copy
        wait_until(lambda: tail.arrived, 10, interval=0.005,
                   what="the tail consumer reading the replay's first copy")
        writer.start()
        time.sleep(1.0)  # the writer commits for at least this long
        wait_until(lambda: long_published(db) == VERSIONS, 300, interval=0.2,
                   what="the replayed versions PUBLISHED again")
        long_s = time.time() - replay_at
        total = writer.stop()
        counts = wait_quiet(db, 120, "every row final after the replay")
        wait_until(lambda: all(oid in tail.arrived for oid in writer.commits), 30,
                   what="every new event seen by the tail consumer")
        tail.stop()
        assert relay.stop() == 0, relay.log_text()[-3000:]

    # The mock keeps about 5 MiB per partition and drops older data silently:
    # the long aggregate's partition, twice 3000 single-message batches, must fit.
    starts = log_starts(own_kafka.bootstrap, topic)
    assert not any(starts.values()), ("the mock broker dropped data: log start offsets %s"
                                      % starts)
    table = db.rows()
    audit = check_audit(db)
    # The replayed versions are second copies by design; a row locked more than
    # once (retried) may have more.
    allowed = {r["outbox_id"] for r in table if r["aggregate_id"] == LONG} | \
        {oid for oid, n in audit.locks.items() if n > 1}
    # The mock answers a fetch with one batch, and the long aggregate went out
    # one message per batch: thousands of fetches, without the round trip.
    own_kafka.set_rtt(0)
    t0 = time.monotonic()
    kc, problems = check_kafka(own_kafka, [topic], table, dup_allowed=allowed, timeout_s=300)
    read_s = time.monotonic() - t0

    late = sorted(((tail.arrived[oid] - c, oid) for oid, c in writer.commits.items()
                   if oid in tail.arrived), reverse=True)
    lat = sorted(x for x, _ in late)
    marked = {r["outbox_id"]: r["published_at"].timestamp() - writer.commits[r["outbox_id"]]
              for r in table if r["outbox_id"] in writer.commits}

    # G2 on the replay itself: the long aggregate's copies appended after the
    # replay began, in offset order, are its versions 1..3000 in order (first
    # copies within the replay; a retried version may repeat).
    copies = sorted((m for m in kc.msgs if header(m, "aggregate-id") == LONG),
                    key=lambda m: m["offset"])
    replayed = [int(header(m, "aggregate-version")) for m in copies
                if m["offset"] >= ends[m["partition"]]]
    seen, order_ok = set(), True
    for v in replayed:
        if v in seen:
            continue
        if seen and v < max(seen):
            order_ok = False
        seen.add(v)

    report("%d versions of %s replayed with a %d ms broker round trip: on Kafka again after "
           "%.1f s, in order %s, %d copies; %d new events of 50 other aggregates: "
           "commit -> arrival p50 %.2f s, p99 %.2f s, max %.2f s (bound %.0f s), %d later than "
           "the bound (commit -> published_at max %.2f s); %s; %d duplicate copies outside "
           "the replay; Kafka read back in %.0f s", VERSIONS, LONG, RTT_MS, long_s, order_ok,
           len(replayed),
           total, lat[len(lat) // 2] if lat else 0, lat[int(len(lat) * 0.99)] if lat else 0,
           lat[-1] if lat else 0, BOUND_S, sum(1 for x in lat if x > BOUND_S),
           max(marked.values()) if marked else 0, counts,
           kc.extra_copies - len(replayed), read_s)

    assert counts["PUBLISHED"] == len(table) and counts["DEAD"] == 0, counts
    assert not audit.violations, audit.violations[:10]
    assert not problems, problems  # G1 and G2 on first copies
    assert order_ok and seen == set(range(1, VERSIONS + 1)), \
        ("the replay of %s out of order or incomplete" % LONG, replayed[:20])
    assert len(late) == total > 0
    assert late[0][0] <= BOUND_S, (
        "new events of other aggregates arrived up to %.2f s after their COMMIT; worst %s"
        % (late[0][0], late[:5]))
