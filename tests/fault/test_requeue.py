"""Scenario 8: an operator requeues DEAD rows with outboxctl (after
fixing what killed them) and their aggregates flow again, in order.

Broker: Apache Kafka (tests/run's)."""
import os
import subprocess

from conftest import actor_url, check_audit, check_kafka, relay_env
from harness import Relay, bin_path, header, wait_until

OUTBOXCTL = bin_path("outboxctl")


def outboxctl(db, *args, expect=0):
    env = {**os.environ, "OUTBOX_DATABASE_URL": actor_url(db.pg.url, "operator"),
           "OUTBOX_TABLE": db.table}
    r = subprocess.run([OUTBOXCTL, *args], env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, timeout=30)
    assert r.returncode == expect, (args, r.returncode, r.stdout, r.stderr)
    return r.stdout


def row(agg, v, **kw):
    r = {"aggregate_type": "Order", "aggregate_id": agg, "aggregate_version": v,
         "event_type": "E", "payload_json": {"v": v}}
    r.update(kw)
    return r


def test_requeue_dead_rows(db, kafka, tmp_path, report):
    topic = "%s.Order" % db.schema
    kafka.create_topic(topic, 4)
    rows = [row("hdr", 1, headers_json="[1]"), row("hdr", 2), row("hdr", 3),
            row("big", 1, payload_json={"pad": "x" * 1_100_000}), row("big", 2),
            row("ok", 1), row("ok", 2)]
    ids = db.insert_events(rows)
    with Relay("outbox-relay", name="r-requeue", log_dir=tmp_path,
               env=relay_env(db, kafka, "r-requeue")) as relay:
        wait_until(lambda: db.status_counts()["DEAD"] == 2 and
                   db.status_counts()["PUBLISHED"] == 2, 30, what="2 DEAD, ok/* PUBLISHED")
        listing = outboxctl(db, "dead")
        assert ids[0] in listing and ids[3] in listing and "INVALID_HEADERS" in listing
        assert "MSG_SIZE_TOO_LARGE" in listing
        stats = outboxctl(db, "stats")
        assert "DEAD" in stats
        # Not DEAD: requeue leaves it alone.
        assert "requeued 0 row(s)" in outboxctl(db, "requeue", "--id", ids[5])
        outboxctl(db, "requeue", expect=2)
        outboxctl(db, "requeue", "--aggregate", "no-slash", expect=2)
        outboxctl(db, "requeue", "--id", "not-a-uuid", expect=2)  # a usage error, not SQL's

        # The operator fixes the headers and requeues by id.
        db.execute("UPDATE %s SET headers_json = '{\"fixed\": true}' WHERE outbox_id = %%s"
                   % db.table, (ids[0],))
        assert "requeued 1 row(s)" in outboxctl(db, "requeue", "--id", ids[0])
        wait_until(lambda: db.count("aggregate_id = 'hdr' AND status = 'PUBLISHED'") == 3, 30,
                   what="hdr/1..3 PUBLISHED after the requeue")
        # ... and the payload, then requeues the aggregate.
        db.execute("UPDATE %s SET payload_json = '{\"pad\": \"small\"}' WHERE outbox_id = %%s"
                   % db.table, (ids[3],))
        assert "requeued 1 row(s)" in outboxctl(db, "requeue", "--aggregate", "Order/big")
        wait_until(lambda: db.status_counts()["PUBLISHED"] == len(rows), 30,
                   what="every row PUBLISHED")
        assert "requeued 0 row(s)" in outboxctl(db, "requeue", "--all-dead",
                                                "--code", "INVALID_HEADERS")
        assert relay.stop() == 0

    table = db.rows()
    requeued = {r["outbox_id"]: r for r in table if r["outbox_id"] in (ids[0], ids[3])}
    assert all(r["attempt_count"] == 1 for r in requeued.values()), "attempts restart at 0"
    audit = check_audit(db)
    assert not audit.violations, audit.violations[:10]
    kc, problems = check_kafka(kafka, [topic], table, dup_allowed=set())
    assert not problems, problems
    assert len(kc.msgs) == len(rows)
    order = {}
    for m in kc.msgs:
        order.setdefault(m["key"], []).append(int(header(m, "aggregate-version")))
    assert order["hdr"] == [1, 2, 3] and order["big"] == [1, 2], order
    report("DEAD hdr/1 (INVALID_HEADERS) and big/1 (MSG_SIZE_TOO_LARGE) listed by "
           "`outboxctl dead`; fixed and requeued with `requeue --id` and `requeue --aggregate "
           "Order/big`; kafka order hdr %s, big %s; non-DEAD rows untouched by requeue; "
           "%d messages, 0 duplicates", order["hdr"], order["big"], len(kc.msgs))
