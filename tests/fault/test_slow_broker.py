"""A slow broker holds only its partitions (G1, G2 and two time bounds).

Broker: a 3-broker Apache Kafka cluster of this module's own (deploy/local/kafka:
brokers 1-3 beside a dedicated KRaft controller, as in test_cluster.py). Topics
have replication factor 3, min.insync.replicas=2 and
message.timestamp.type=LogAppendTime, so a record's timestamp is the moment its
leader appended it, on this machine's clock. The relay runs with its production
Kafka settings (acks=all, idempotence, delivery.timeout.ms 120 s, librdkafka's own
request and socket timeouts).

A writer commits events over 1000 aggregates, 250 a second, and one broker, the
leader of some of the relay's partitions, is SIGSTOPped for 40 s: its connections
stay open and silent. Kafka itself takes no acks=all write on a partition whose
in-sync set still holds the stopped broker until the controller drops it from
the in-sync sets (broker.session.timeout.ms 6 s, replica.lag.time.max.ms 10 s in
deploy/local/kafka). A probe, a plain idempotent producer (confluent_kafka,
acks=all), writes to one partition led by each healthy broker every 5 ms; its
first acknowledgement after the stall is "the moment" that broker takes writes
again. Asserted:

  - every event of a partition led by a healthy broker at the SIGSTOP, committed
    before the SIGCONT, is appended within 2 s of its COMMIT or of its leader's
    moment, whichever is later;
  - every partition the stopped broker led has an event appended within 25 s of
    the SIGSTOP (after leadership moved to a healthy broker);
  - every row ends PUBLISHED and on Kafka (G1), first copies in version order per
    aggregate (G2), duplicates only of rows locked more than once.

The versions an aggregate gathers while nothing is acknowledged go out one
Kafka round trip each once it is (G2: version n is settled before n + 1 is
produced), so with few aggregates the first bound would time that queue on a
loaded machine rather than what the stopped broker holds: at 1000 aggregates
each gets a version every 4 s, one or two behind the stall (the report says the
most).
"""
import collections
import threading
import time

import pytest
from confluent_kafka import Producer

from conftest import Writer, check_audit, check_kafka, relay_env, wait_quiet
from harness import KafkaCluster, Relay, header, wait_until

BROKERS = (1, 2, 3)
PARTITIONS = 6
STOP_S = 40.0
HEALTHY_BOUND_S = 2.0    # after max(commit, the leader's moment)
VICTIM_BOUND_S = 25.0    # after the SIGSTOP
PROBE_PERIOD_S = 0.005
AGGREGATES = 1000  # the writer's: a version of each every 4 s at 250 events/s
TOPIC_CONFIG = {"min.insync.replicas": 2, "message.timestamp.type": "LogAppendTime"}


@pytest.fixture(scope="module")
def cluster():
    with KafkaCluster(nodes=3, controller=True) as c:
        yield c


class Probe(threading.Thread):
    """A plain idempotent producer (acks=all, linger 0) sending one message to
    each of `partitions` of `topic` every PROBE_PERIOD_S until stop(); .acks[p]
    lists the wall-clock times at which partition p's acknowledgements arrived."""

    def __init__(self, bootstrap, topic, partitions):
        super().__init__(daemon=True)
        self.topic, self.partitions = topic, list(partitions)
        self.acks = {p: [] for p in self.partitions}
        self.errors = []
        self._halt = threading.Event()
        self.producer = Producer({"bootstrap.servers": bootstrap, "acks": "all",
                                  "enable.idempotence": True, "linger.ms": 0,
                                  "message.timeout.ms": 300000, "log_level": 0})

    def _delivered(self, err, msg):
        if err is None:
            self.acks[msg.partition()].append(time.time())
        else:
            self.errors.append(str(err))

    def run(self):
        next_at = time.monotonic()
        while not self._halt.is_set():
            for p in self.partitions:
                self.producer.produce(self.topic, b"probe", partition=p,
                                      on_delivery=self._delivered)
            next_at += PROBE_PERIOD_S
            while True:  # serve delivery reports until the next send is due
                left = next_at - time.monotonic()
                self.producer.poll(max(0.0, left))
                if left <= 0:
                    break

    def stop(self):
        self._halt.set()
        self.join(10)
        left = self.producer.flush(60)
        assert left == 0, "probe: %d messages unacknowledged" % left

    def moment(self, partition, after):
        """The first acknowledgement later than `after` (None if none)."""
        return next((t for t in self.acks[partition] if t > after), None)

    def longest_gap(self, partition, start, end):
        """Longest wait between acknowledgements within [start, end] (s)."""
        ts = [start] + [t for t in self.acks[partition] if start < t <= end] + [end]
        return max(b - a for a, b in zip(ts, ts[1:]))


def first_copies(msgs):
    """{event-id: the message of its earliest append}."""
    out = {}
    for m in msgs:
        eid = header(m, "event-id")
        if eid not in out or m["timestamp"] < out[eid]["timestamp"]:
            out[eid] = m
    return out


def test_slow_broker_holds_only_its_partitions(db, cluster, tmp_path, report):
    topic = "%s.Order" % db.schema
    probe_topic = "%s.probe" % db.schema
    cluster.create_topic(topic, PARTITIONS, 3, TOPIC_CONFIG)
    cluster.create_topic(probe_topic, PARTITIONS, 3, TOPIC_CONFIG)
    leaders = {p: lead for p, (lead, _) in cluster.leaders(topic).items()}
    victim = leaders[0]
    healthy = [b for b in BROKERS if b != victim]
    probe_leaders = {p: lead for p, (lead, _) in cluster.leaders(probe_topic).items()}
    probe_part = {}
    for p, lead in sorted(probe_leaders.items()):
        probe_part.setdefault(lead, p)
    assert all(b in probe_part for b in healthy), ("no probe partition led by each healthy "
                                                   "broker", probe_leaders)
    env = relay_env(db, cluster, "r-slow", OUTBOX_MAX_ATTEMPTS=1000,
                    OUTBOX_KAFKA_DELIVERY_TIMEOUT_MS=120000)
    writer = Writer(db, "s", aggregates=AGGREGATES, per_tx=10, period=0.04)
    probe = Probe(cluster.bootstrap, probe_topic, [probe_part[b] for b in healthy])
    with Relay("outbox-relay", name="r-slow", log_dir=tmp_path, env=env) as relay:
        writer.start()
        probe.start()
        wait_until(lambda: db.count("status = 'PUBLISHED'") >= 500, 60, interval=0.1,
                   what="500 rows published before the SIGSTOP")
        leaders = {p: lead for p, (lead, _) in cluster.leaders(topic).items()}
        assert list(leaders.values()).count(victim) >= 1
        stop_at = time.time()
        with cluster.paused(victim):
            time.sleep(STOP_S)  # the length of the hang is the variable under test
            cont_at = time.time()
        wait_until(lambda: all(len(isr) == 3 for _, isr in cluster.leaders(topic).values()),
                   90, interval=0.2, what="every partition with 3 in sync after SIGCONT")
        target = db.count("status = 'PUBLISHED'") + 300
        wait_until(lambda: db.count("status = 'PUBLISHED'") >= target, 90, interval=0.1,
                   what="rows published after SIGCONT")
        probe.stop()
        total = writer.stop()
        counts = wait_quiet(db, 180, "every row final after the SIGSTOP")
        assert relay.stop() == 0, relay.log_text()[-3000:]

    table = db.rows()
    audit = check_audit(db)
    retried = {oid for oid, n in audit.locks.items() if n > 1}
    kc, problems = check_kafka(cluster, [topic], table, dup_allowed=retried)
    first = first_copies(kc.msgs)

    # "The moment" each healthy broker took acks=all writes again.
    moment = {b: probe.moment(probe_part[b], stop_at + 0.5) for b in healthy}
    stall = {b: probe.longest_gap(probe_part[b], stop_at, cont_at) for b in healthy}

    # Events of partitions led by a healthy broker, committed before the SIGCONT.
    late = []  # (seconds after max(commit, moment), event id, partition)
    for eid, c in writer.commits.items():
        m = first.get(eid)
        lead = leaders[m["partition"]] if m else None
        if m is None or lead == victim or c > cont_at or m["timestamp"] / 1e3 < stop_at:
            continue
        since = max(c, moment[lead] or cont_at)
        late.append((m["timestamp"] / 1e3 - since, eid, m["partition"], c - stop_at))
    late.sort(reverse=True)
    # The most versions of one aggregate committed before its leader's moment
    # and appended after it: the queue its run works through a round trip each.
    behind = collections.Counter()
    for eid, c in writer.commits.items():
        m = first.get(eid)
        lead = leaders[m["partition"]] if m else victim
        if lead != victim and moment[lead] and c < moment[lead] < m["timestamp"] / 1e3:
            behind[m["key"]] += 1

    # The stopped broker's partitions: the first append after the SIGSTOP.
    back = {}
    for m in kc.msgs:
        t = m["timestamp"] / 1e3
        if leaders[m["partition"]] == victim and t > stop_at:
            back[m["partition"]] = min(back.get(m["partition"], t), t)
    victim_parts = sorted(p for p, lead in leaders.items() if lead == victim)
    back_s = {p: (back[p] - stop_at if p in back else None) for p in victim_parts}

    report("broker %d (leader of partitions %s) SIGSTOPped %.0f s; Kafka took acks=all "
           "writes again after %s s (probe, per healthy broker; its longest stall %s s); "
           "healthy-led events: %d, latest %.2f s after max(commit, moment) (bound %.0f s), "
           "%d later than the bound (latest: (late s, committed s after the SIGSTOP, partition) %s); "
           "at most %d versions of one aggregate waiting at the moment; the stopped broker's "
           "partitions took writes again "
           "after %s s (bound %.0f s); %d events, %s, %d duplicate copies, audit "
           "violations %d, Kafka problems %d",
           victim, victim_parts, STOP_S,
           {b: round(moment[b] - stop_at, 2) if moment[b] else None for b in healthy},
           {b: round(s, 2) for b, s in stall.items()}, len(late),
           late[0][0] if late else 0.0, HEALTHY_BOUND_S,
           sum(1 for x in late if x[0] > HEALTHY_BOUND_S),
           [(round(x[0], 2), round(x[3], 1), x[2]) for x in late[:8]],
           max(behind.values(), default=0),
           {p: round(s, 2) if s is not None else None for p, s in back_s.items()},
           VICTIM_BOUND_S, total, counts, kc.extra_copies, len(audit.violations),
           len(problems))

    assert not probe.errors, probe.errors[:5]
    assert counts["PUBLISHED"] == total and counts["DEAD"] == 0, (counts, total)
    assert not audit.violations, audit.violations[:10]
    assert not problems, problems  # G1 and G2
    assert len(kc.ids) == total
    assert all(moment.values()), ("the probe never got an acknowledgement after the stall",
                                  moment)
    assert late, "no event of a healthy broker's partition committed during the stop"
    assert late[0][0] <= HEALTHY_BOUND_S, (
        "events of partitions led by healthy brokers appended up to %.2f s after max(commit, "
        "moment); worst: %s" % (late[0][0], late[:5]))
    slow = {p: s for p, s in back_s.items() if s is None or s > VICTIM_BOUND_S}
    assert not slow, ("the stopped broker's partitions took no write within %.0f s of the "
                      "SIGSTOP: %s" % (VICTIM_BOUND_S, slow))
