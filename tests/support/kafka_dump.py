#!/usr/bin/python3
"""Dump Kafka topics as JSON lines (or readable blocks), for tests and the demo.

    kafka_dump.py --bootstrap HOST:PORT[,...] [--topic T ... | --pattern REGEX] [--pretty]

Reads every partition of the chosen topics from the beginning up to the high
watermark captured at start, without a consumer group (assign + seek), and
prints one JSON object per message, sorted by topic, partition, offset:

    {"topic", "partition", "offset", "timestamp", "key", "value", "headers"}

key/value are UTF-8 strings or null (a null value is a tombstone); a value
that is not UTF-8 is given as base64 under "value_b64" instead (key likewise
under "key_b64"). headers is a list of [name, value-string] pairs in order.
With neither --topic nor --pattern every topic is read.

Importable: read_topics(bootstrap, topics=None, pattern=None) -> list of dicts.

Run with /usr/bin/python3 (Debian's kafka-python). The API version is pinned
because kafka-python's probing misdetects librdkafka's mock cluster.
"""

import argparse
import base64
import json
import re
import sys
import time

import kafka.codec
import kafka.record.default_records
import zstandard
from kafka import KafkaConsumer, TopicPartition


def _zstd_decode(payload):
    """librdkafka's zstd frames may leave out the content size, and then
    kafka-python's decoder stops at 1 MiB of output: decode as a stream."""
    return zstandard.ZstdDecompressor().decompressobj().decompress(payload)


kafka.codec.zstd_decode = _zstd_decode
kafka.record.default_records.zstd_decode = _zstd_decode

# kafka-python's version probe does not recognise the mock's ApiVersions
# answer; (2, 5, 0) uses the protocol versions the mock implements.
API_VERSION = (2, 5, 0)


def _consumer(bootstrap, timeout_s, security=None):
    return KafkaConsumer(
        **(security or {}),
        bootstrap_servers=bootstrap.split(","),
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        api_version=API_VERSION,
        request_timeout_ms=max(int(timeout_s * 1000), 10000) + 5000,
        metadata_max_age_ms=5000,
        fetch_max_wait_ms=100,
        client_id="kafka-dump",
    )


def _text_or_b64(data, name, out):
    """Stores bytes as out[name] (UTF-8 text) or out[name + '_b64']."""
    if data is None:
        out[name] = None
        return
    try:
        out[name] = data.decode("utf-8")
    except UnicodeDecodeError:
        out[name] = None
        out[name + "_b64"] = base64.b64encode(data).decode("ascii")


def _header_value(v):
    if v is None:
        return None
    try:
        return v.decode("utf-8")
    except UnicodeDecodeError:
        return "base64:" + base64.b64encode(v).decode("ascii")


def _to_dict(rec):
    msg = {
        "topic": rec.topic,
        "partition": rec.partition,
        "offset": rec.offset,
        "timestamp": rec.timestamp,
    }
    _text_or_b64(rec.key, "key", msg)
    _text_or_b64(rec.value, "value", msg)
    msg["headers"] = [[k, _header_value(v)] for k, v in (rec.headers or [])]
    return msg


def _partitions(consumer, topic, deadline):
    """Partition ids of topic, waiting for metadata until deadline."""
    while True:
        parts = consumer.partitions_for_topic(topic)
        if parts:
            return sorted(parts)
        if time.monotonic() >= deadline:
            return []
        time.sleep(0.05)


def read_topics(bootstrap, topics=None, pattern=None, timeout_s=30.0, security=None):
    """Returns every message of the topics, from offset 0 (or the log start)
    to the high watermark read at the start, as dicts sorted by (topic,
    partition, offset). topics: list of names; pattern: regex applied with
    re.search to the cluster's topic list; neither: all topics except
    internal ones (names starting with '__'). A named topic
    that does not exist yields no messages. Raises TimeoutError if the data
    up to the watermarks could not be read within timeout_s. security:
    kafka-python settings for a secured listener, e.g. {"security_protocol":
    "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512", "sasl_plain_username": ...,
    "sasl_plain_password": ..., "ssl_cafile": ...}."""
    if topics and pattern:
        raise ValueError("give topics or pattern, not both")
    deadline = time.monotonic() + timeout_s
    consumer = _consumer(bootstrap, timeout_s, security)
    try:
        if topics:
            names = sorted(set(topics))
        else:
            rx = re.compile(pattern) if pattern else None
            names = sorted(
                t for t in consumer.topics()
                if not t.startswith("__") and (rx is None or rx.search(t))
            )
        tps = []
        for t in names:
            # An explicitly named topic may not exist (yet): don't wait long.
            part_deadline = min(deadline, time.monotonic() + 2.0)
            tps.extend(TopicPartition(t, p) for p in _partitions(consumer, t, part_deadline))
        if not tps:
            return []
        consumer.assign(tps)
        end = consumer.end_offsets(tps)
        consumer.seek_to_beginning(*tps)
        pending = {tp for tp in tps if end[tp] > consumer.position(tp)}
        messages = []
        while pending:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    "kafka_dump: timed out reading %s" % sorted(str(tp) for tp in pending))
            batch = consumer.poll(timeout_ms=200, max_records=10000)
            for tp, recs in batch.items():
                for rec in recs:
                    if rec.offset < end[tp]:
                        messages.append(_to_dict(rec))
            for tp in list(pending):
                if consumer.position(tp) >= end[tp]:
                    pending.discard(tp)
                    consumer.pause(tp)
        messages.sort(key=lambda m: (m["topic"], m["partition"], m["offset"]))
        return messages
    finally:
        consumer.close(autocommit=False)


def _print_pretty(m, out):
    out.write("--- %s [%d] @%d  key=%s\n" % (m["topic"], m["partition"], m["offset"],
                                             json.dumps(m["key"])))
    for name, value in m["headers"]:
        out.write("    %s: %s\n" % (name, value))
    if m.get("value_b64") is not None:
        out.write("    (binary value, base64) %s\n" % m["value_b64"])
    elif m["value"] is None:
        out.write("    (tombstone)\n")
    else:
        value = m["value"]
        try:
            value = json.dumps(json.loads(value), indent=2, ensure_ascii=False)
        except ValueError:
            pass
        out.write("".join("    " + line + "\n" for line in value.splitlines()))


def main(argv=None):
    ap = argparse.ArgumentParser(description="Dump Kafka topics as JSON lines.")
    ap.add_argument("--bootstrap", required=True, help="host:port[,host:port...]")
    sel = ap.add_mutually_exclusive_group()
    sel.add_argument("--topic", action="append", help="topic to read (repeatable)")
    sel.add_argument("--pattern", help="regex selecting topics (re.search)")
    ap.add_argument("--pretty", action="store_true", help="readable blocks, not JSON")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds (default 30)")
    args = ap.parse_args(argv)

    try:
        messages = read_topics(args.bootstrap, topics=args.topic, pattern=args.pattern,
                               timeout_s=args.timeout)
    except Exception as e:  # one line, no traceback, for shell use
        print("kafka_dump: %s: %s" % (type(e).__name__, e), file=sys.stderr)
        return 1
    out = sys.stdout
    for m in messages:
        if args.pretty:
            _print_pretty(m, out)
        else:
            out.write(json.dumps(m, ensure_ascii=False) + "\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
