"""OUTBOX_SERIALIZATION=avro end to end: rows in PostgreSQL, messages read back
from the broker with kafka-python and decoded with an independent Avro
implementation (Debian's python3-avro), every field checked. The registry is
tests/support/fake_registry.py (the Confluent REST API for subjects/versions
and ids)."""
import base64
import io
import json
import re
import os
import struct
import time

import avro.io
import avro.schema

from conftest import relay_env
from fake_registry import FakeRegistry
from harness import Relay, header, read_topics, repo_root, wait_until

AVSC = os.path.join(repo_root(), "schemas", "avro", "outbox_envelope.avsc")
ENVELOPE_FIELDS = ["event_id", "event_type", "event_version", "tenant_id", "aggregate_type",
                   "aggregate_id", "aggregate_version", "occurred_at", "correlation_id",
                   "causation_id", "trace_id", "payload"]

# ------------------------------------------------------------ helpers (also used by
# test_debezium_parity.py)

_CRC64_EMPTY = 0xc15d213aa4d7a795


def crc64_avro(data):
    """CRC-64-AVRO, written from the Avro specification (independent of the relay)."""
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (_CRC64_EMPTY & -(fp & 1))
        table.append(fp)
    fp = _CRC64_EMPTY
    for b in data:
        fp = (fp >> 8) ^ table[(fp ^ b) & 0xff]
    return fp


def envelope_schema(extra_fields=()):
    """python3-avro's parse of the repository's .avsc, with optional appended
    ["null","string"] fields as OUTBOX_ENVELOPE_FIELDS adds them."""
    with open(AVSC, encoding="utf-8") as f:
        doc = json.load(f)
    for name in extra_fields:
        doc["fields"].append({"name": name, "type": ["null", "string"], "default": None})
    return avro.schema.parse(json.dumps(doc))


def raw_value(msg):
    """The message value as bytes (kafka_dump gives text or base64), None for a tombstone."""
    if "value_b64" in msg:
        return base64.b64decode(msg["value_b64"])
    return None if msg["value"] is None else msg["value"].encode("utf-8")


def decode_datum(schema, data):
    return avro.io.DatumReader(schema).read(avro.io.BinaryDecoder(io.BytesIO(data)))


def decode_single_object(schema, data):
    """Checks the single-object header (C3 01 + fingerprint of the canonical form
    python3-avro computes) and decodes the datum."""
    assert data[:2] == b"\xc3\x01", data[:10]
    (fp,) = struct.unpack("<Q", data[2:10])
    assert fp == crc64_avro(schema.canonical_form.encode()), (hex(fp), schema.canonical_form)
    return decode_datum(schema, data[10:])


def decode_confluent(registry, data):
    """Checks magic 0, fetches the writer schema by id from the registry (as a
    consumer would, over its REST API) and decodes. Returns (id, datum)."""
    import urllib.request
    assert data[0] == 0, data[:5]
    (sid,) = struct.unpack(">I", data[1:5])
    with urllib.request.urlopen("%s/schemas/ids/%d" % (registry.url, sid), timeout=5) as r:
        schema = avro.schema.parse(json.load(r)["schema"])
    return sid, decode_datum(schema, data[5:])


def check_envelope(datum, row):
    """Every envelope field against the table row."""
    assert list(datum)[:len(ENVELOPE_FIELDS)] == ENVELOPE_FIELDS
    assert datum["event_id"] == row["outbox_id"]
    assert datum["event_type"] == row["event_type"]
    assert datum["event_version"] == row["event_version"]
    assert datum["tenant_id"] == row["tenant_id"]
    assert datum["aggregate_type"] == row["aggregate_type"]
    assert datum["aggregate_id"] == row["aggregate_id"]
    assert datum["aggregate_version"] == row["aggregate_version"]
    assert datum["occurred_at"].endswith("Z")
    assert abs(__import__("datetime").datetime.fromisoformat(
        datum["occurred_at"].replace("Z", "+00:00")) - row["occurred_at"]).total_seconds() < 1e-5
    for k in ("correlation_id", "causation_id", "trace_id"):
        assert datum[k] == row[k], k
    assert json.loads(datum["payload"]) == row["payload_json"]


def tombstone_ids(db):
    """outbox_ids whose payload_json is SQL NULL (psycopg2 also gives None for JSON null)."""
    return {r["id"] for r in db.execute(
        "SELECT outbox_id::text AS id FROM %s WHERE payload_json IS NULL" % db.table)}


def published(db, n):
    return lambda: db.status_counts()["PUBLISHED"] == n


def sample_rows():
    return [
        {"aggregate_type": "Order", "aggregate_id": "o1", "aggregate_version": 1,
         "event_type": "OrderCreated", "event_version": 3, "tenant_id": "acme",
         "payload_json": {"total": 12.5, "items": [1, 2], "note": "caf\u00e9 \u2603 \"q\""},
         "correlation_id": "corr-1", "causation_id": "cause-1", "trace_id": "trace-1",
         "event_key": "ek-1", "headers_json": {"x-a": "b"}},
        {"aggregate_type": "Order", "aggregate_id": "o1", "aggregate_version": 2,
         "event_type": "OrderPaid", "payload_json": "\"just a string\""},
        {"aggregate_type": "Order", "aggregate_id": "o2", "aggregate_version": 1,
         "event_type": "OrderShipped", "payload_json": {"big": "x" * 5000}},
        {"aggregate_type": "Order", "aggregate_id": "o3", "aggregate_version": 1,
         "event_type": "OrderDeleted", "payload_json": None},  # tombstone
        {"aggregate_type": "Order", "aggregate_id": "o4", "aggregate_version": 9000000000,
         "event_type": "Json null", "payload_json": "null"},  # JSON null, not a tombstone
    ]


# ------------------------------------------------------------ tests

def test_single_object_encoding_without_registry(db, kafka, tmp_path):
    rows = sample_rows()
    ids = db.insert_events(rows)
    env = relay_env(db, kafka, OUTBOX_SERIALIZATION="avro")
    with Relay("outbox-relay", env=env, log_dir=tmp_path) as relay:
        wait_until(published(db, len(rows)), 60, what="all rows PUBLISHED")
        assert relay.stop() == 0
    table = {r["outbox_id"]: r for r in db.rows()}
    msgs = read_topics(kafka.bootstrap, topics=["%s.Order" % db.schema])
    assert sorted(header(m, "event-id") for m in msgs) == sorted(ids)
    schema = envelope_schema()
    tombs = tombstone_ids(db)
    assert tombs == {ids[3]}
    for m in msgs:
        row = table[header(m, "event-id")]
        assert header(m, "content-type") == "application/avro"
        assert header(m, "schema-id") is None
        assert header(m, "event-type") == row["event_type"]
        data = raw_value(m)
        if row["outbox_id"] in tombs:
            assert data is None, "a NULL payload is a tombstone"
            continue
        check_envelope(decode_single_object(schema, data), row)
    assert table[ids[0]]["payload_json"]["note"] == "caf\u00e9 \u2603 \"q\""


def test_confluent_wire_format_with_registry(db, kafka, tmp_path):
    rows = sample_rows()
    rows.append({"aggregate_type": "Invoice", "aggregate_id": "i1", "aggregate_version": 1,
                 "event_type": "InvoiceSent", "payload_json": {"n": 1}})
    ids = db.insert_events(rows)
    with FakeRegistry() as reg:
        env = relay_env(db, kafka, OUTBOX_SERIALIZATION="avro",
                        OUTBOX_SCHEMA_REGISTRY_URL=reg.url + "/", OUTBOX_BATCH_SIZE=2)
        with Relay("outbox-relay", env=env, log_dir=tmp_path) as relay:
            wait_until(published(db, len(rows)), 60, what="all rows PUBLISHED")
            assert relay.stop() == 0
        table = {r["outbox_id"]: r for r in db.rows()}
        topics = ["%s.Order" % db.schema, "%s.Invoice" % db.schema]
        msgs = read_topics(kafka.bootstrap, topics=topics)
        assert sorted(header(m, "event-id") for m in msgs) == sorted(ids)
        tombs = tombstone_ids(db)
        for m in msgs:
            row = table[header(m, "event-id")]
            assert header(m, "content-type") == "application/avro"
            data = raw_value(m)
            if row["outbox_id"] in tombs:
                assert data is None and header(m, "schema-id") is None
                continue
            sid, datum = decode_confluent(reg, data)
            assert header(m, "schema-id") == str(sid)
            check_envelope(datum, row)
            # the registered schema is ours (same canonical form as the .avsc)
            latest = reg.latest("%s-value" % m["topic"])
            assert latest["id"] == sid
            assert avro.schema.parse(latest["schema"]).canonical_form == \
                envelope_schema().canonical_form
        # subjects are <topic>-value; each registered once per relay (the id is cached)
        posts = reg.posts()
        subjects = sorted(p.split("/")[2] for p, _ in posts)
        assert subjects == sorted("%s-value" % t for t in topics), posts


# relay.c UNCOUNTED_PAUSE_MAX_S: the longest pause of the lock while every
# event fails for a cause outside the rows (with the test's settings, half the
# stall bound: about 5 s).
UNCOUNTED_PAUSE_MAX_S = 10


def test_a_registry_outage_costs_the_database_little(db, kafka, tmp_path):
    """A registry outage with a backlog: every batch fails alike (the rows
    are fine), so the relay locks less often, up to one batch a pause (at
    most UNCOUNTED_PAUSE_MAX_S, below the stall bound), instead of cycling the backlog through lock and
    mark at full speed (21,000 row updates a second with 20,000 rows), and
    says so once; it publishes within that pause of the registry's return."""
    rows = [{"aggregate_type": "Order", "aggregate_id": "o%d" % i, "aggregate_version": 1,
             "event_type": "E", "payload_json": {"i": i}} for i in range(3000)]
    with FakeRegistry() as reg:
        reg.fail_with = 503
        db.insert_events(rows)
        env = relay_env(db, kafka, OUTBOX_SERIALIZATION="avro",
                        OUTBOX_SCHEMA_REGISTRY_URL=reg.url)
        with Relay("outbox-relay", env=env, log_dir=tmp_path) as relay:
            def said(msg):
                return [ln for ln in relay.log_text().splitlines() if 'msg="%s"' % msg in ln]
            wait_until(lambda: said("every event fails for a cause outside the rows: "
                                    "locking less often"), 30, what="the pause said")

            def updates():
                return db.execute("SELECT n_tup_upd AS n FROM "
                                  "pg_stat_user_tables WHERE relid = %s::regclass",
                                  (db.table,))[0]["n"]
            db.execute("SELECT pg_stat_clear_snapshot()")
            u0, t0 = updates(), time.monotonic()
            time.sleep(15)  # the span measured: nothing to wait for
            db.execute("SELECT pg_stat_clear_snapshot()")
            per_s = (updates() - u0) / (time.monotonic() - t0)
            assert db.count("status = 'DEAD'") == 0
            reg.fail_with = None
            back = time.monotonic()
            wait_until(lambda: db.count("status = 'PUBLISHED'") == len(rows),
                       UNCOUNTED_PAUSE_MAX_S + 30, what="all published after the outage")
            took = time.monotonic() - back
            assert said("events published again: locking at the usual pace")
            assert relay.stop() == 0
    # one batch (500 rows, a lock and a mark each) per pause (about 5 s) at
    # most, 200 a second, with room for a loaded machine; cycling the backlog
    # is thousands a second
    assert per_s < 600, "%.0f row updates a second during the outage" % per_s
    assert took < UNCOUNTED_PAUSE_MAX_S + 20, took


def test_registry_down_rows_fail_retriably_then_publish(db, kafka, tmp_path):
    rows = [{"aggregate_type": "Order", "aggregate_id": "o%d" % i, "aggregate_version": 1,
             "event_type": "E", "payload_json": {"i": i}} for i in range(5)]
    rows.append({"aggregate_type": "Order", "aggregate_id": "gone", "aggregate_version": 1,
                 "event_type": "Deleted", "payload_json": None})
    with FakeRegistry() as reg:
        reg.fail_with = 503
        db.insert_events(rows)
        env = relay_env(db, kafka, OUTBOX_SERIALIZATION="avro",
                        OUTBOX_SCHEMA_REGISTRY_URL=reg.url, OUTBOX_BACKOFF_INITIAL_MS=200,
                        OUTBOX_BACKOFF_MAX_MS=400, OUTBOX_MAX_ATTEMPTS=2)
        with Relay("outbox-relay", env=env, log_dir=tmp_path) as relay:
            # more attempts than OUTBOX_MAX_ATTEMPTS while down: FAILED with the registry
            # code, never DEAD, and the attempts are not counted (attempt_count stays 0);
            # the tombstone needs no schema and goes through
            def registry_failures():
                return len(re.findall(r'msg="events failed, will retry".*err=REGISTRY_UNAVAILABLE',
                                      relay.log_text()))
            wait_until(lambda: registry_failures() >= 3, 60, what="three failed attempts")
            # the rows are read in the same statement that sees all five FAILED: with a
            # 200-400 ms backoff they are locked again soon after
            failed = []

            def all_failed(where="status = 'FAILED'", params=None):
                failed[:] = db.rows(where=where, params=params)
                return len(failed) == 5
            wait_until(all_failed, 10, what="rows FAILED")
            assert {r["last_error_code"] for r in failed} == {"REGISTRY_UNAVAILABLE"}
            wait_until(lambda: db.count("status = 'PUBLISHED'") == 1, 20,
                       what="the tombstone PUBLISHED")
            counts = db.status_counts()
            assert counts["DEAD"] == 0 and counts["PUBLISHED"] == 1, counts
            assert all("HTTP 503" in r["last_error_message"] for r in failed)
            assert all(r["attempt_count"] == 0 for r in failed), failed
            # down in another way: the connection drops without an answer
            reg.fail_with = "close"
            seen = registry_failures()
            wait_until(lambda: registry_failures() >= seen + 3 and
                       all_failed("status = 'FAILED' AND last_error_message NOT LIKE %s",
                                  ("%HTTP 503%",)),
                       30, what="more attempts against a dropping registry")
            assert {r["last_error_code"] for r in failed} == {"REGISTRY_UNAVAILABLE"}
            assert all(r["attempt_count"] == 0 for r in failed), failed
            assert db.status_counts()["DEAD"] == 0
            reg.fail_with = None
            wait_until(published(db, len(rows)), 30, what="rows PUBLISHED after the registry is up")
            assert relay.stop() == 0
        msgs = read_topics(kafka.bootstrap, topics=["%s.Order" % db.schema])
        assert len(msgs) == len(rows)
        for m in msgs:
            if m["key"] != "gone":
                sid, datum = decode_confluent(reg, raw_value(m))
                assert json.loads(datum["payload"]) == {"i": int(m["key"][1:])}
                assert header(m, "schema-id") == str(sid)


def test_registry_rejection_is_retriable_not_dead(db, kafka, tmp_path):
    db.insert_events([{"aggregate_type": "Order", "aggregate_id": "o1", "aggregate_version": 1,
                       "event_type": "E", "payload_json": {}}])
    with FakeRegistry() as reg:
        reg.fail_with = 409
        env = relay_env(db, kafka, OUTBOX_SERIALIZATION="avro",
                        OUTBOX_SCHEMA_REGISTRY_URL=reg.url, OUTBOX_BACKOFF_INITIAL_MS=100,
                        OUTBOX_BACKOFF_MAX_MS=200)
        with Relay("outbox-relay", env=env, log_dir=tmp_path) as relay:
            wait_until(lambda: db.count("status = 'FAILED' AND attempt_count >= 2") == 1, 30,
                       what="row FAILED twice")
            (row,) = db.rows()
            assert row["last_error_code"] == "REGISTRY_REJECTED"
            assert "HTTP 409" in row["last_error_message"]
            reg.fail_with = None
            wait_until(published(db, 1), 30, what="row PUBLISHED")
            assert relay.stop() == 0


def test_lookup_only_registry_never_registers(db, kafka, tmp_path):
    # A registry where this client may not register (403), as production
    # registries often are: the relay only looks the schema up.
    ids = db.insert_events([{"aggregate_type": "Order", "aggregate_id": "o1",
                             "aggregate_version": 1, "event_type": "E",
                             "payload_json": {"k": 1}}])
    subject = "%s.Order-value" % db.schema
    with FakeRegistry() as reg:
        reg.refuse_register = True
        env = relay_env(db, kafka, OUTBOX_SERIALIZATION="avro",
                        OUTBOX_SCHEMA_REGISTRY_URL=reg.url,
                        OUTBOX_SCHEMA_REGISTRY_AUTO_REGISTER="false",
                        OUTBOX_BACKOFF_INITIAL_MS=100, OUTBOX_BACKOFF_MAX_MS=200)
        with Relay("outbox-relay", env=env, log_dir=tmp_path) as relay:
            wait_until(lambda: db.count("status = 'FAILED' AND attempt_count >= 2") == 1, 30,
                       what="row FAILED twice: schema not registered")
            (row,) = db.rows()
            assert row["last_error_code"] == "REGISTRY_REJECTED"
            assert "not registered" in row["last_error_message"]
            # an operator (or CI) registers the schema; the relay finds it
            with open(os.path.join(repo_root(), "schemas", "avro", "outbox_envelope.avsc")) as f:
                sid = reg.register(subject, f.read())
            wait_until(published(db, 1), 30, what="row PUBLISHED once the schema is registered")
            assert relay.stop() == 0
        assert {p for p, _ in reg.posts()} == {"/subjects/%s" % subject}
        (m,) = read_topics(kafka.bootstrap, topics=["%s.Order" % db.schema])
        assert header(m, "event-id") == ids[0]
        assert header(m, "schema-id") == str(sid)
        got, datum = decode_confluent(reg, raw_value(m))
        assert got == sid and json.loads(datum["payload"]) == {"k": 1}


def test_payload_value_format_is_an_avro_string(db, kafka, tmp_path):
    ids = db.insert_events([{"aggregate_type": "Order", "aggregate_id": "o1",
                             "aggregate_version": 1, "event_type": "E",
                             "payload_json": {"hello": "w\u00f6rld"}}])
    with FakeRegistry() as reg:
        env = relay_env(db, kafka, OUTBOX_SERIALIZATION="avro", OUTBOX_VALUE_FORMAT="payload",
                        OUTBOX_SCHEMA_REGISTRY_URL=reg.url)
        with Relay("outbox-relay", env=env, log_dir=tmp_path) as relay:
            wait_until(published(db, 1), 30, what="row PUBLISHED")
            assert relay.stop() == 0
        (m,) = read_topics(kafka.bootstrap, topics=["%s.Order" % db.schema])
        assert header(m, "event-id") == ids[0]
        sid, datum = decode_confluent(reg, raw_value(m))
        assert json.loads(datum) == {"hello": "w\u00f6rld"}
        assert json.loads(reg.schema_by_id(sid)) == "string"


def test_bad_avro_configuration_exits_2(db, kafka, tmp_path):
    for i, (extra, want) in enumerate([
        ({"OUTBOX_SERIALIZATION": "json", "OUTBOX_SCHEMA_REGISTRY_URL": "http://127.0.0.1:1"},
         "OUTBOX_SCHEMA_REGISTRY_URL"),
        ({"OUTBOX_SERIALIZATION": "avro", "OUTBOX_SCHEMA_REGISTRY_URL": "127.0.0.1:1"},
         "OUTBOX_SCHEMA_REGISTRY_URL"),
        ({"OUTBOX_SERIALIZATION": "avro", "OUTBOX_ENVELOPE_FIELDS": "headers_json.a-b"},
         "OUTBOX_ENVELOPE_FIELDS"),
    ]):
        relay = Relay("outbox-relay", env=relay_env(db, kafka, **extra), log_dir=tmp_path,
                      name="bad%d" % i)
        assert relay.wait(20) == 2
        assert want in relay.log_text()
