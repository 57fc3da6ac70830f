"""Routing and formats a Debezium outbox-event-router user expects:
OUTBOX_VALUE_FORMAT=payload, tombstones in every format, {tenant_id} and
{event_type} topic placeholders, and OUTBOX_ENVELOPE_FIELDS (Debezium's
table.fields.additional.placement=...:envelope:...). Every check reads the
topics back; Avro values are decoded with python3-avro."""
import json

import pytest

from conftest import relay_env
from fake_registry import FakeRegistry
from harness import Relay, header, read_topics, wait_until
from test_avro import (check_envelope, decode_confluent, decode_single_object, envelope_schema,
                       raw_value, tombstone_ids)


def published(db, n):
    return lambda: db.status_counts()["PUBLISHED"] == n


def _publish(db, kafka, tmp_path, env, aggregate_type):
    """One relay until both rows are PUBLISHED; returns (rows by outbox_id,
    the messages on the aggregate type's topic)."""
    with Relay("outbox-relay", env=env, log_dir=tmp_path) as relay:
        wait_until(published(db, 2), 30, what="rows PUBLISHED")
        assert relay.stop() == 0
    table = {r["outbox_id"]: r for r in db.rows()}
    return table, read_topics(kafka.bootstrap, topics=["%s.%s" % (db.schema, aggregate_type)])


FORMATS = [
    ("json", "envelope"),
    ("json", "payload"),
    ("avro", "envelope"),
    ("avro", "payload"),
    ("avro+registry", "envelope"),
    ("avro+registry", "payload"),
]


@pytest.mark.parametrize("serialization,value_format", FORMATS)
def test_tombstones_and_values_in_every_format(db, kafka, tmp_path, serialization,
                                               value_format):
    rows = [
        {"aggregate_type": "Customer", "aggregate_id": "c1", "aggregate_version": 1,
         "event_type": "CustomerCreated", "payload_json": {"name": "Ann"}},
        {"aggregate_type": "Customer", "aggregate_id": "c1", "aggregate_version": 2,
         "event_type": "CustomerDeleted", "payload_json": None},
    ]
    ids = db.insert_events(rows)
    env = relay_env(db, kafka, OUTBOX_VALUE_FORMAT=value_format,
                    OUTBOX_SERIALIZATION=serialization.split("+")[0])
    reg = FakeRegistry() if serialization == "avro+registry" else None
    try:
        if reg:
            env["OUTBOX_SCHEMA_REGISTRY_URL"] = reg.url
        table, msgs = _publish(db, kafka, tmp_path, env, "Customer")
        by_id = {header(m, "event-id"): m for m in msgs}
        assert set(by_id) == set(ids)
        tomb = by_id[ids[1]]
        assert tomb["value"] is None and "value_b64" not in tomb, tomb
        assert tomb["key"] == "c1"
        assert header(tomb, "event-type") == "CustomerDeleted"
        assert header(tomb, "schema-id") is None
        m = by_id[ids[0]]
        want_ct = "application/json" if serialization == "json" else "application/avro"
        assert header(m, "content-type") == header(tomb, "content-type") == want_ct
        data = raw_value(m)
        if serialization == "json":
            value = json.loads(data)
            if value_format == "payload":
                assert value == {"name": "Ann"}
            else:
                assert value["payload"] == {"name": "Ann"} and value["event_id"] == ids[0]
        elif serialization == "avro":
            schema = envelope_schema() if value_format == "envelope" else \
                __import__("avro.schema").schema.parse('"string"')
            datum = decode_single_object(schema, data)
            if value_format == "payload":
                assert json.loads(datum) == {"name": "Ann"}
            else:
                check_envelope(datum, table[ids[0]])
        else:
            sid, datum = decode_confluent(reg, data)
            assert header(m, "schema-id") == str(sid)
            if value_format == "payload":
                assert json.loads(datum) == {"name": "Ann"}
            else:
                check_envelope(datum, table[ids[0]])
    finally:
        if reg:
            reg.close()


def test_topic_placeholders_route_by_tenant_and_event_type(db, kafka, tmp_path):
    rows = [
        {"aggregate_type": "Order", "aggregate_id": "o1", "aggregate_version": 1,
         "event_type": "OrderCreated", "tenant_id": "acme", "payload_json": {"n": 1}},
        {"aggregate_type": "Order", "aggregate_id": "o2", "aggregate_version": 1,
         "event_type": "OrderCreated", "tenant_id": "globex", "payload_json": {"n": 2}},
        {"aggregate_type": "Order", "aggregate_id": "o3", "aggregate_version": 1,
         "event_type": "OrderCancelled", "tenant_id": "acme", "payload_json": None},
        {"aggregate_type": "Order", "aggregate_id": "o4", "aggregate_version": 1,
         "event_type": "OrderCreated", "tenant_id": "acme", "payload_json": {"n": 4},
         "topic_name": "%s.override" % db.schema},  # a row's topic_name wins
    ]
    ids = db.insert_events(rows)
    with FakeRegistry() as reg:
        env = relay_env(db, kafka, OUTBOX_SERIALIZATION="avro",
                        OUTBOX_SCHEMA_REGISTRY_URL=reg.url,
                        OUTBOX_TOPIC_TEMPLATE="%s.{tenant_id}.{event_type}" % db.schema)
        with Relay("outbox-relay", env=env, log_dir=tmp_path) as relay:
            wait_until(published(db, 4), 30, what="rows PUBLISHED")
            assert relay.stop() == 0
        msgs = read_topics(kafka.bootstrap, pattern="^%s\\." % db.schema)
        topic = {header(m, "event-id"): m["topic"] for m in msgs}
        s = db.schema
        assert topic == {ids[0]: "%s.acme.OrderCreated" % s, ids[1]: "%s.globex.OrderCreated" % s,
                         ids[2]: "%s.acme.OrderCancelled" % s, ids[3]: "%s.override" % s}
        # one subject per topic that carried a value (the tombstone's topic needs none)
        assert sorted(p.split("/")[2] for p, _ in reg.posts()) == sorted(
            "%s-value" % t for t in ("%s.acme.OrderCreated" % s, "%s.globex.OrderCreated" % s,
                                     "%s.override" % s))


FIELDS = "event_key,headers_json.region,headers_json.x-tenant-tier:tier,partition_key:pk"


def _field_rows():
    return [
        {"aggregate_type": "Order", "aggregate_id": "o1", "aggregate_version": 1,
         "event_type": "E", "payload_json": {"n": 1}, "event_key": "ek-1", "partition_key": "p1",
         "headers_json": {"region": "eu-west", "x-tenant-tier": 3, "x-keep": "stays"}},
        {"aggregate_type": "Order", "aggregate_id": "o2", "aggregate_version": 1,
         "event_type": "E", "payload_json": {"n": 2}},  # every placed field absent: null
    ]


def _check_placement(m, extra, row):
    names = [h[0] for h in m["headers"]]
    # placed members and event_key are no longer headers; the rest stay
    assert "region" not in names and "x-tenant-tier" not in names and "event-key" not in names
    if row["aggregate_id"] == "o1":
        assert header(m, "x-keep") == "stays"
        assert extra == {"event_key": "ek-1", "region": "eu-west", "tier": "3", "pk": "p1"}
    else:
        assert extra == {"event_key": None, "region": None, "tier": None, "pk": None}


def test_envelope_fields_json(db, kafka, tmp_path):
    ids = db.insert_events(_field_rows())
    env = relay_env(db, kafka, OUTBOX_ENVELOPE_FIELDS=FIELDS)
    table, msgs = _publish(db, kafka, tmp_path, env, "Order")
    assert sorted(header(m, "event-id") for m in msgs) == sorted(ids)
    for m in msgs:
        value = json.loads(m["value"])
        row = table[header(m, "event-id")]
        assert list(value)[-4:] == ["event_key", "region", "tier", "pk"]
        assert value["payload"] == row["payload_json"]
        _check_placement(m, {k: value[k] for k in ("event_key", "region", "tier", "pk")}, row)


@pytest.mark.parametrize("registry", [False, True])
def test_envelope_fields_avro(db, kafka, tmp_path, registry):
    ids = db.insert_events(_field_rows())
    reg = FakeRegistry() if registry else None
    try:
        env = relay_env(db, kafka, OUTBOX_SERIALIZATION="avro", OUTBOX_ENVELOPE_FIELDS=FIELDS)
        if reg:
            env["OUTBOX_SCHEMA_REGISTRY_URL"] = reg.url
        table, msgs = _publish(db, kafka, tmp_path, env, "Order")
        assert sorted(header(m, "event-id") for m in msgs) == sorted(ids)
        schema = envelope_schema(["event_key", "region", "tier", "pk"])
        for m in msgs:
            row = table[header(m, "event-id")]
            if reg:
                _, datum = decode_confluent(reg, raw_value(m))
            else:
                datum = decode_single_object(schema, raw_value(m))
            check_envelope(datum, row)
            _check_placement(m, {k: datum[k] for k in ("event_key", "region", "tier", "pk")}, row)
        assert not tombstone_ids(db)
    finally:
        if reg:
            reg.close()
