"""Debezium and outbox-relay on the same outbox_event rows, compared message by
message on the same Apache Kafka broker.

Debezium 3.7 (its PostgreSQL connector with pgoutput and the outbox EventRouter, in
Kafka Connect standalone, tests/bench/debezium/connect) streams three tables of one
PostgreSQL server started with wal_level=logical; outbox-relay then publishes the
same rows with the settings docs/debezium.md maps. Both write into the
same topics; a message is Debezium's when it has the `id` header, ours when it has
`event-id`. docs/debezium.md's table says which of its rows this test observes.

- routing: default routing (route.by.field=aggregate_type, key aggregate_id) against
  OUTBOX_VALUE_FORMAT=payload and the {aggregate_type} template
- overrides: every row names its topic_name and partition_key; Debezium needs
  route.by.field=topic_name and table.field.event.key=partition_key for that
- envelope: table.fields.additional.placement=...:envelope against
  OUTBOX_VALUE_FORMAT=envelope and OUTBOX_ENVELOPE_FIELDS
"""
import datetime
import json
import os
import sys

import pytest

from conftest import relay_env
from harness import Postgres, Relay, TestSchema, header, read_topics, wait_until

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench", "debezium"))
import dbz  # noqa: E402

PARTITIONS = 3

# Debezium's headers (beside the placed columns, named as ours) and their counterparts.
DBZ_CONTEXT = ("__debezium.context.connectorLogicalName", "__debezium.context.taskId",
               "__debezium.context.connectorName", "__debezium.context.runId")
PLACED = ("event-type", "aggregate-type", "aggregate-id", "aggregate-version", "tenant-id",
          "occurred-at")

NESTED = {"order": {"id": "o-1", "lines": [{"sku": "A-1", "qty": 2, "price": 9.5},
                                           {"sku": "B-2", "qty": 1, "price": 120.25}]},
          "customer": {"name": "Zoë Ångström", "city": "Zürich", "note": "„quoted“ ✓ 😀"},
          "flags": [True, False], "total": 139.25, "count": 3, "big": 12345678901234}
ESCAPES = {"s": "a\"b\\c\nd\te", "empty": "", "nul_member": None, "no_items": [],
           "deep": {"a": {"b": {"c": [[1, 2], [3]]}}}, "obj": {}}

# Payloads Debezium's JSON expansion does not keep as they are (see docs/debezium.md): the
# value Debezium sent, observed with Debezium 3.7.0.
QUIRKS = [
    ("q-text", '"just text"', json.dumps('"just text"')),
    ("q-null", "null", json.dumps("null")),
    ("q-mixed", '{"mixed": [1, "a"]}', json.dumps('{"mixed": [1, "a"]}')),
    ("q-objs", '{"objs": [{"x": 1}, {"y": "b"}]}',
     json.dumps({"objs": [{"x": 1, "y": None}, {"x": None, "y": "b"}]})),
]


class Side:
    pass


@pytest.fixture(scope="module")
def side(kafka, tmp_path_factory):
    """A wal_level=logical PostgreSQL with the three tables, their topics, and one
    Debezium connector streaming all three (one EventRouter per table)."""
    s = Side()
    s.kafka = kafka
    s.pg = Postgres(settings={"PG_WAL_LEVEL": "logical"})
    s.tmp = tmp_path_factory.mktemp("dbz")
    s.routing = TestSchema(s.pg, "routing")
    s.overrides = TestSchema(s.pg, "overrides")
    s.envelope = TestSchema(s.pg, "envelope")
    connect = None
    try:
        r, o, e = s.routing.schema, s.overrides.schema, s.envelope.schema
        for t in ("%s.Order" % r, "%s.Customer" % r, "%s.Quirk" % r, "%s.custom-1" % o,
                  "%s.custom-2" % o, "%s.Order" % e):
            kafka.create_topic(t, partitions=PARTITIONS)
        dbz.prepare_database(s.pg, [x.table for x in (s.routing, s.overrides, s.envelope)],
                             "dbz_side")
        routes = [
            (r, dbz.router_settings("%s.${routedByValue}" % r)),
            (o, dbz.router_settings("${routedByValue}", route__by__field="topic_name",
                                    table__field__event__key="partition_key")),
            (e, dbz.router_settings("%s.${routedByValue}" % e, **{
                "table.fields.additional.placement": ",".join([
                    "event_type:envelope", "aggregate_id:envelope",
                    "aggregate_version:envelope", "event_key:envelope",
                    "partition_key:envelope:pk"])})),
        ]
        props = dbz.connector_properties("outbox-side", s.pg.url, "dbz_side", "dbz_side", routes)
        # A small heap and C1 only: a quicker start on two cores (the bench runs
        # Connect with its distribution's defaults).
        connect = dbz.Connect(str(s.tmp / "connect"), kafka.bootstrap, props,
                              env={"CONNECT_HEAP_OPTS": "-Xms64m -Xmx384m",
                                   "CONNECT_JVM_OPTS": "-XX:+UseSerialGC -XX:TieredStopAtLevel=1"})
        s.connect = connect
        print("Connect started in %.1f s" % connect.start_s)
        yield s
    finally:
        if connect:
            connect.stop()
        for t in (s.routing, s.overrides, s.envelope):
            t.drop()
        s.pg.close()  # Connect's logs stay in pytest's temporary directory


def publish_both(side, db, rows, topics, **relay_settings):
    """Inserts rows, waits until Debezium sent all of them, then runs one relay on
    the table until they are PUBLISHED. Returns ({outbox_id: row},
    {outbox_id: Debezium's message}, {outbox_id: ours}, every message read)."""
    ids = db.insert_events(rows)
    n = len(ids)

    def dbz_msgs():
        msgs = read_topics(side.kafka.bootstrap, topics=topics)
        got = {header(m, "id"): m for m in msgs if header(m, "id") in ids}
        return got if len(got) == n else None
    wait_until(lambda: side.connect.task_state() == "RUNNING" and dbz_msgs(), 60,
               what="Debezium sent %d messages" % n)
    env = relay_env(db, side.kafka, OUTBOX_KAFKA_PARTITIONER="murmur2_random", **relay_settings)
    with Relay("outbox-relay", env=env, log_dir=str(side.tmp)) as relay:
        wait_until(lambda: db.status_counts()["PUBLISHED"] == n, 30, what="rows PUBLISHED")
        assert relay.stop() == 0
    msgs = read_topics(side.kafka.bootstrap, topics=topics)
    theirs = {header(m, "id"): m for m in msgs if header(m, "id") is not None}
    ours = {header(m, "event-id"): m for m in msgs if header(m, "event-id") is not None}
    assert sorted(theirs) == sorted(ids) and sorted(ours) == sorted(ids), \
        "each system sent each row once"
    assert len(msgs) == 2 * n
    table = {r["outbox_id"]: r for r in db.rows()}
    return table, theirs, ours, msgs


def check_same_route(theirs, ours):
    """Same topic, key and partition (murmur2 on both sides) for every event."""
    for eid, d in theirs.items():
        m = ours[eid]
        assert (m["topic"], m["key"], m["partition"]) == (d["topic"], d["key"], d["partition"]), \
            (eid, d, m)


def check_order(table, theirs, ours):
    """Per aggregate, both systems wrote the versions in the same, increasing order
    into one partition."""
    for msgs in (theirs, ours):
        seq = {}
        for eid, m in sorted(msgs.items(), key=lambda kv: (kv[1]["partition"], kv[1]["offset"])):
            row = table[eid]
            seq.setdefault((row["aggregate_type"], row["aggregate_id"]), []).append(
                (m["topic"], m["partition"], row["aggregate_version"]))
        for agg, s in seq.items():
            assert len({(t, p) for t, p, _ in s}) == 1, (agg, s)
            versions = [v for _, _, v in s]
            assert versions == sorted(versions), (agg, versions)


def check_headers(table, theirs, ours):
    """Every header Debezium sets has its counterpart in ours."""
    for eid, d in theirs.items():
        m, row = ours[eid], table[eid]
        names = [h[0] for h in d["headers"]]
        assert sorted(names) == sorted(DBZ_CONTEXT + ("id",) + PLACED + ("headers_json",)), names
        assert header(d, "id") == header(m, "event-id") == eid
        for name in PLACED[:-1]:
            assert header(d, name) == header(m, name), (name, d, m)
        # occurred-at: both RFC 3339 in UTC, to the microsecond
        t = [datetime.datetime.fromisoformat(header(x, "occurred-at").replace("Z", "+00:00"))
             for x in (d, m)]
        assert t[0] == t[1] == row["occurred_at"], t
        # headers_json: Debezium sends the whole object as one header, we send
        # each member as its own header (strings as they are, the rest as JSON)
        members = json.loads(header(d, "headers_json"))
        assert members == row["headers_json"]
        for k, v in members.items():
            got = header(m, k)
            assert (got == v) if isinstance(v, str) else (json.loads(got) == v), (k, got, v)
        # Debezium's context headers: the connector's name against our producer
        # name; the task id, connector type and run id have no counterpart
        assert header(d, DBZ_CONTEXT[0]) == "dbz" and header(m, "producer") == "outbox-relay"
        assert header(m, "content-type") == "application/json"


def rows_routing():
    rows = []
    for agg, n in (("o1", 3), ("o2", 2), ("o3", 1)):
        for v in range(1, n + 1):
            rows.append({"aggregate_type": "Order", "aggregate_id": agg, "aggregate_version": v,
                         "event_type": "OrderV%d" % v,
                         "payload_json": {**NESTED, "v": v, "agg": agg},
                         "headers_json": {"region": "eu-west", "x-tier": v, "x-obj": {"a": [1, 2]}}})
    rows.append({"aggregate_type": "Customer", "aggregate_id": "c1", "aggregate_version": 1,
                 "event_type": "CustomerCreated", "payload_json": ESCAPES,
                 "tenant_id": "acme", "headers_json": {"ünïcode": "välue ✓"}})
    rows.append({"aggregate_type": "Customer", "aggregate_id": "c1", "aggregate_version": 2,
                 "event_type": "CustomerDeleted", "payload_json": None, "tenant_id": "acme"})
    for agg, payload, _ in QUIRKS:
        rows.append({"aggregate_type": "Quirk", "aggregate_id": agg, "aggregate_version": 1,
                     "event_type": "Quirk", "payload_json": payload})
    return rows


def test_routing_by_aggregate_type_payload_values(side):
    r = side.routing.schema
    table, theirs, ours, _ = publish_both(
        side, side.routing, rows_routing(),
        ["%s.Order" % r, "%s.Customer" % r, "%s.Quirk" % r],
        OUTBOX_VALUE_FORMAT="payload", OUTBOX_TOPIC_TEMPLATE="%s.{aggregate_type}" % r)
    check_same_route(theirs, ours)
    check_order(table, theirs, ours)
    check_headers(table, theirs, ours)
    quirks = {agg: want for agg, _, want in QUIRKS}
    for eid, d in theirs.items():
        m, row = ours[eid], table[eid]
        assert d["topic"] == "%s.%s" % (r, row["aggregate_type"]) and d["key"] == row["aggregate_id"]
        if row["aggregate_id"] in quirks:
            # ours: the payload as stored; Debezium: what its expansion made of it
            assert json.loads(m["value"]) == row["payload_json"]
            assert json.loads(d["value"]) == json.loads(quirks[row["aggregate_id"]]), d["value"]
        elif row["payload_json"] is None:
            assert d["value"] is None and m["value"] is None  # both tombstones
        else:
            assert json.loads(m["value"]) == json.loads(d["value"]) == row["payload_json"]


def test_topic_name_and_partition_key_overrides(side):
    o = side.overrides.schema
    rows = []
    for i, (agg, n) in enumerate((("o1", 3), ("o2", 2), ("o3", 2), ("o4", 1))):
        for v in range(1, n + 1):
            rows.append({"aggregate_type": "Order", "aggregate_id": agg, "aggregate_version": v,
                         "event_type": "OrderChanged", "payload_json": {"agg": agg, "v": v},
                         "topic_name": "%s.custom-%d" % (o, 1 + i % 2),
                         "partition_key": "tenant-%d" % (i // 2)})
    rows.append({"aggregate_type": "Order", "aggregate_id": "o5", "aggregate_version": 1,
                 "event_type": "OrderDeleted", "payload_json": None,
                 "topic_name": "%s.custom-2" % o, "partition_key": "tenant-9"})
    table, theirs, ours, _ = publish_both(
        side, side.overrides, rows, ["%s.custom-1" % o, "%s.custom-2" % o],
        OUTBOX_VALUE_FORMAT="payload")
    check_same_route(theirs, ours)
    check_order(table, theirs, ours)
    check_headers(table, theirs, ours)
    for eid, d in theirs.items():
        row = table[eid]
        assert (d["topic"], d["key"]) == (row["topic_name"], row["partition_key"])
        want = None if row["payload_json"] is None else row["payload_json"]
        got = [None if x["value"] is None else json.loads(x["value"]) for x in (d, ours[eid])]
        assert got == [want, want]


def test_envelope_placement(side):
    e = side.envelope.schema
    rows = [{"aggregate_type": "Order", "aggregate_id": "o%d" % a, "aggregate_version": v,
             "event_type": "OrderChanged", "payload_json": {**NESTED, "v": v},
             "event_key": "ek-%d-%d" % (a, v) if a == 1 else None,
             "partition_key": "pk-%d" % a if a == 2 else None}
            for a in (1, 2, 3) for v in (1, 2)]
    rows.append({"aggregate_type": "Order", "aggregate_id": "o3", "aggregate_version": 3,
                 "event_type": "OrderDeleted", "payload_json": None})
    table, theirs, ours, _ = publish_both(
        side, side.envelope, rows, ["%s.Order" % e],
        OUTBOX_TOPIC_TEMPLATE="%s.{aggregate_type}" % e, OUTBOX_VALUE_FORMAT="envelope",
        OUTBOX_ENVELOPE_FIELDS="event_key,partition_key:pk")
    for eid, d in theirs.items():
        m, row = ours[eid], table[eid]
        assert d["topic"] == m["topic"]
        # Debezium's key stays the aggregate id; ours is the partition key when set
        assert d["key"] == row["aggregate_id"]
        assert m["key"] == (row["partition_key"] or row["aggregate_id"])
        if row["payload_json"] is None:
            assert d["value"] is None and m["value"] is None
            continue
        dv, mv = json.loads(d["value"]), json.loads(m["value"])
        assert sorted(dv) == ["aggregate_id", "aggregate_version", "event_key", "event_type",
                              "payload", "pk"]
        # every member of Debezium's envelope is in ours, with the same value
        assert {k: mv.get(k) for k in dv} == dv, (dv, mv)
        assert mv["event_id"] == eid


def test_top_level_json_array_stops_debezium(side):
    """A payload that is a JSON array: Debezium's expansion fails and the task
    stops (FAILED, until restarted by hand); the relay publishes it as it is. Last
    in the module: the connector stays down."""
    r = side.routing.schema
    ids = side.routing.insert_events([{"aggregate_type": "Quirk", "aggregate_id": "q-array",
                                       "aggregate_version": 1, "event_type": "Quirk",
                                       "payload_json": "[1, 2, 3]"}])
    wait_until(lambda: side.connect.task_state() == "FAILED", 30, what="Debezium task FAILED")
    assert "Invalid type for ARRAY" in side.connect.log_text()
    env = relay_env(side.routing, side.kafka, OUTBOX_VALUE_FORMAT="payload",
                    OUTBOX_TOPIC_TEMPLATE="%s.{aggregate_type}" % r)
    with Relay("outbox-relay", env=env, log_dir=str(side.tmp)) as relay:
        wait_until(lambda: side.routing.count("outbox_id = %s AND status = 'PUBLISHED'",
                                              (ids[0],)) == 1, 30, what="array row PUBLISHED")
        assert relay.stop() == 0
    msgs = [m for m in read_topics(side.kafka.bootstrap, topics=["%s.Quirk" % r])
            if ids[0] in (header(m, "id"), header(m, "event-id"))]
    assert [(header(m, "event-id"), json.loads(m["value"])) for m in msgs] == [(ids[0], [1, 2, 3])]
