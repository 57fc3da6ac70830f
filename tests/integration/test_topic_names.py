"""A row whose topic is not a legal Kafka topic name (1-249 characters of
a-z A-Z 0-9 . _ -, neither "." nor "..") goes DEAD at once, last_error_code
INVALID_VALUE, its last_error_message naming the column the name came from
(topic_name, or the column OUTBOX_TOPIC_TEMPLATE placed: aggregate_type,
event_type, tenant_id). It is never sent, and it stops nothing but the later
versions of its own aggregate (G4): the ordinary rows beside it go out
(Apache Kafka, read back)."""
from conftest import relay_env
from harness import Relay, header, make_events, read_topics, wait_until

SETTLE_S = 20


def row(agg, version=1, **cols):
    r = {"aggregate_type": "Order", "aggregate_id": agg, "aggregate_version": version,
         "event_type": "Changed", "payload_json": {"agg": agg}}
    r.update(cols)
    return r


def test_illegal_topics_go_dead_naming_the_column(db, kafka, tmp_path, report):
    template = "%s.{aggregate_type}.{event_type}.{tenant_id}" % db.schema
    ordinary_topic = "%s.Order.Changed.default" % db.schema
    kafka.create_topic(ordinary_topic, 4)
    ordinary = db.insert_events(make_events(aggregates=50, event_type="Changed", id_prefix="ok"))
    bad = {
        "space": (row("space", topic_name="orders topic"), "topic_name"),
        "slash": (row("slash", topic_name="orders/eu"), "topic_name"),
        "dots": (row("dots", topic_name=".."), "topic_name"),
        "long": (row("long", topic_name="t" * 250), "topic_name"),
        "nonascii": (row("nonascii", topic_name="caf\u00e9"), "topic_name"),
        "type": (row("type", aggregate_type="Sales Order"), "aggregate_type"),
        "event": (row("event", event_type="Order/Created"), "event_type"),
        "tenant": (row("tenant", tenant_id="acme:eu"), "tenant_id"),
        "toolong": (row("toolong", aggregate_type="A" * 240), "aggregate_type"),
    }
    ids = {k: db.insert_events([r])[0] for k, (r, _) in bad.items()}
    held = db.insert_events([row("space", 2)])[0]  # behind its DEAD version 1
    env = relay_env(db, kafka, OUTBOX_TOPIC_TEMPLATE=template)
    with Relay("outbox-relay", env=env, log_dir=tmp_path) as relay:
        wait_until(lambda: db.count("outbox_id = ANY(%s::uuid[]) AND status = 'DEAD'",
                                    (list(ids.values()),)) == len(ids), SETTLE_S,
                   what="every row with an illegal topic DEAD")
        wait_until(lambda: db.count("outbox_id = ANY(%s::uuid[]) AND status = 'PUBLISHED'",
                                    (ordinary,)) == len(ordinary), SETTLE_S,
                   what="the ordinary rows PUBLISHED")
        assert relay.stop() == 0
    for k, (r, column) in bad.items():
        (got,) = db.rows(where="outbox_id = %s", params=(ids[k],))
        assert got["last_error_code"] == "INVALID_VALUE", (k, got["last_error_code"])
        assert got["last_error_message"].startswith(column + ":"), (k, got["last_error_message"])
        assert got["attempt_count"] <= 1, (k, got["attempt_count"])  # never retried
    (behind,) = db.rows(where="outbox_id = %s", params=(held,))
    assert behind["status"] != "PUBLISHED", behind
    msgs = read_topics(kafka.bootstrap, topics=[ordinary_topic])
    assert {header(m, "event-id") for m in msgs} == set(ordinary)
    (example,) = db.rows(where="outbox_id = %s", params=(ids["type"],))
    report("%d rows with illegal topics DEAD (INVALID_VALUE) at their first attempt, e.g. %r;"
           " 50 ordinary rows published", len(bad), example["last_error_message"])
