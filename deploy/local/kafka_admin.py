#!/usr/bin/python3
"""Cluster administration for deploy/local/kafka and the tests, through
librdkafka (Debian's python3-confluent-kafka), which speaks Kafka 4's
protocol versions.

    kafka_admin.py wait BOOTSTRAP [--brokers N] [--timeout S]
    kafka_admin.py create BOOTSTRAP NAME [--partitions N] [--replication R] [--config K=V]...
    kafka_admin.py leaders BOOTSTRAP TOPIC       one line per partition: "P LEADER ISR,..."

Importable: wait_brokers(), create_topic(), leaders(), end_offsets().
"""

import argparse
import sys
import time

from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic


def client(bootstrap, extra=None):
    conf = {"bootstrap.servers": bootstrap, "socket.timeout.ms": 5000,
            "log_level": 0}
    conf.update(extra or {})
    return AdminClient(conf)


def wait_brokers(bootstrap, brokers=1, timeout=60.0, extra=None):
    """Waits until metadata lists `brokers` brokers and a controller; True if
    it did within timeout seconds."""
    deadline = time.monotonic() + timeout
    a = client(bootstrap, extra)
    while time.monotonic() < deadline:
        try:
            md = a.list_topics(timeout=2)
            if len(md.brokers) >= brokers and md.controller_id >= 0:
                return True
        except KafkaException:
            pass
        time.sleep(0.2)
    return False


def leaders(bootstrap, topic, timeout=10.0, extra=None):
    """{partition: (leader id, [isr ids])} of topic (leader -1 when none)."""
    md = client(bootstrap, extra).list_topics(topic=topic, timeout=timeout)
    t = md.topics.get(topic)
    if t is None or t.error is not None:
        return {}
    return {p.id: (p.leader, list(p.isrs)) for p in t.partitions.values()}


def end_offsets(bootstrap, topic, timeout=10.0, extra=None):
    """{partition: high watermark} of topic."""
    conf = {"bootstrap.servers": bootstrap, "group.id": "kafka-admin", "log_level": 0,
            "enable.auto.commit": False}
    conf.update(extra or {})
    c = Consumer(conf)
    try:
        return {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout)[1]
                for p in leaders(bootstrap, topic, timeout, extra)}
    finally:
        c.close()


def create_topic(bootstrap, name, partitions=1, replication=1, config=None, timeout=30.0,
                 extra=None):
    """Creates a topic and waits until every partition has a leader with a
    full ISR. Raises RuntimeError on failure."""
    a = client(bootstrap, extra)
    fut = a.create_topics([NewTopic(name, num_partitions=partitions,
                                    replication_factor=replication,
                                    config=dict(config or {}))],
                          operation_timeout=timeout, request_timeout=timeout)
    try:
        fut[name].result(timeout)
    except KafkaException as e:
        raise RuntimeError("creating topic %s: %s" % (name, e)) from None
    # Each broker learns of the topic from the controller on its own time, and
    # a client asks whichever broker it reaches first: wait until every one of
    # the bootstrap brokers answers with every partition led and in full ISR.
    deadline = time.monotonic() + timeout
    for server in bootstrap.split(","):
        while True:
            try:
                ls = leaders(server, name, timeout=2, extra=extra)
            except KafkaException:
                ls = {}
            if len(ls) == partitions and all(lead >= 0 and len(isr) == replication
                                             for lead, isr in ls.values()):
                break
            if time.monotonic() >= deadline:
                raise RuntimeError("topic %s: broker %s lists partitions without a leader "
                                   "or full ISR after %.0fs" % (name, server, timeout))
            time.sleep(0.1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("wait")
    w.add_argument("bootstrap")
    w.add_argument("--brokers", type=int, default=1)
    w.add_argument("--timeout", type=float, default=60)
    c = sub.add_parser("create")
    c.add_argument("bootstrap")
    c.add_argument("name")
    c.add_argument("--partitions", type=int, default=1)
    c.add_argument("--replication", type=int, default=1)
    c.add_argument("--config", action="append", default=[], metavar="K=V")
    lp = sub.add_parser("leaders")
    lp.add_argument("bootstrap")
    lp.add_argument("topic")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "wait":
            return 0 if wait_brokers(args.bootstrap, args.brokers, args.timeout) else 1
        if args.cmd == "create":
            conf = {}
            for kv in args.config:
                k, sep, v = kv.partition("=")
                if not sep:
                    ap.error("--config takes K=V, not %r" % kv)
                conf[k] = v
            create_topic(args.bootstrap, args.name, args.partitions, args.replication, conf)
            return 0
        for p, (lead, isr) in sorted(leaders(args.bootstrap, args.topic).items()):
            print("%d %d %s" % (p, lead, ",".join(map(str, isr))))
        return 0
    except (RuntimeError, KafkaException) as e:
        print("kafka_admin: %s" % e, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
