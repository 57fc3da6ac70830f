"""Scenario 1 (G1, G2, G3): three relays on one table, 20k events over 500
aggregates with 40 versions each, half inserted before the relays start and
half while they run, by a writer whose transactions commit out of version
order on purpose. Also: a relay holds at most two batches (the one in
flight and the next).

Broker: Apache Kafka (tests/run's), stopped (SIGSTOP) for a moment to hold a
batch in flight."""
import time

from conftest import check_audit, check_kafka, db_lag_s, relay_env, write_out_of_order
from harness import Relay, make_events, wait_until

AGGREGATES = 500
VERSIONS = 40
RELAYS = 3
MAX_BATCHES = 4  # relay.c MAX_BATCHES: a relay holds at most 4 x OUTBOX_BATCH_SIZE rows


def test_three_relays_20k_events(db, kafka, tmp_path, report):
    topic = "%s.Order" % db.schema
    kafka.create_topic(topic, 8)
    rows = make_events(aggregates=AGGREGATES, versions=VERSIONS, aggregate_type="Order")
    total = len(rows)
    half = total // 2
    db.insert_events(rows[:half])
    started = time.monotonic()
    relays = [Relay("outbox-relay", name="r%d" % i, log_dir=tmp_path,
                    env=relay_env(db, kafka, "r%d" % i, OUTBOX_BATCH_SIZE=200))
              for i in range(1, RELAYS + 1)]
    try:
        # The rest arrives while they work, from a writer whose transactions
        # commit out of version order on purpose: G2 must still hold.
        reversed_pairs = write_out_of_order(db, rows[half:], chunk=1000, delay=0.5)
        wait_until(lambda: db.status_counts()["PUBLISHED"] == total, 240, interval=0.2,
                   what="all %d rows PUBLISHED" % total)
        elapsed = time.monotonic() - started
        for r in relays:
            assert r.running(), "%s died: %s" % (r.name, r.log_text()[-2000:])
    finally:
        codes = [r.stop(timeout=30) for r in relays]
    assert codes == [0] * RELAYS, codes

    table = db.rows()
    assert len(table) == total
    assert all(r["status"] == "PUBLISHED" and r["locked_by"] is None for r in table)
    audit = check_audit(db)
    assert not audit.violations, audit.violations[:10]
    per_relay = {r.name: 0 for r in relays}
    for row in db.execute("SELECT new_locked_by AS who, count(*) AS n FROM %s.lock_audit "
                          "WHERE new_status = 'PUBLISHING' GROUP BY 1" % db.schema):
        per_relay[row["who"]] = row["n"]
    # Without faults every row is attempted (produced) exactly once. A lock may
    # take a later version whose run another relay broke (its predecessor
    # locked there meanwhile): that row goes back unattempted, never produced.
    released = sum(audit.unattempted.values())
    assert audit.lock_count - released == total, \
        "every row attempted exactly once without faults (%d locks, %d given back " \
        "unattempted)" % (audit.lock_count, released)
    assert released <= total // 100, "at most 1 %% of locks given back: %d" % released
    assert all(r["attempt_count"] == 1 for r in table)
    assert all(n > 0 for n in per_relay.values()), per_relay
    # no relay held more than MAX_BATCHES batches' rows at once
    assert all(n <= MAX_BATCHES * 200 for n in audit.max_held.values()), dict(audit.max_held)

    kc, problems = check_kafka(kafka, [topic], table, dup_allowed=audit.relocked_after_stale)
    assert not problems, problems
    assert len(kc.ids) == total
    report("%d events (half from a writer committing %d transaction pairs in reverse "
           "version order), %d aggregates x %d versions, %d relays: all PUBLISHED in %.1fs; "
           "locks per relay %s, most rows held at once %s; audit: %d locks, 0 overlapping; "
           "%d given back unattempted; kafka: %d messages, %d distinct, %d duplicates, "
           "order ok in %d partitions; "
           "max lag %.2fs (kafka), "
           "%.2fs (table)",
           total, reversed_pairs, AGGREGATES, VERSIONS, RELAYS, elapsed, per_relay,
           dict(audit.max_held),
           audit.lock_count, released,
           len(kc.msgs), len(kc.ids), kc.extra_copies,
           len({(m["topic"], m["partition"]) for m in kc.msgs}), kc.max_lag_s, db_lag_s(db))


def test_relay_locks_the_next_batch_while_publishing(db, kafka, tmp_path, report):
    """The relay locks more batches while the first is on its way to Kafka (a
    stopped broker keeps it there): it holds MAX_BATCHES batches' rows at
    once, never more, and every version still reaches Kafka after its
    predecessor (G2)."""
    topic = "%s.Order" % db.schema
    kafka.create_topic(topic, 4)
    rows = make_events(aggregates=1000, versions=3, aggregate_type="Order")
    db.insert_events(rows)
    held = lambda: db.count("status = 'PUBLISHING'")  # noqa: E731
    relay = None
    try:
        with kafka.paused():  # shorter than the delivery timeout: no attempt fails
            relay = Relay("outbox-relay", name="r-ahead", log_dir=tmp_path,
                          env=relay_env(db, kafka, "r-ahead", OUTBOX_BATCH_SIZE=100,
                                        # queued before the producer has a broker:
                                        # no timeout while the test holds it stopped
                                        OUTBOX_KAFKA_DELIVERY_TIMEOUT_MS=30000))
            wait_until(lambda: held() == MAX_BATCHES * 100, 10, interval=0.02,
                       what="%d batches' rows held while the first is in flight" % MAX_BATCHES)
            time.sleep(0.5)  # would it lock more meanwhile?
            assert held() == MAX_BATCHES * 100
        wait_until(lambda: db.status_counts()["PUBLISHED"] == len(rows), 120,
                   interval=0.2, what="all %d rows PUBLISHED" % len(rows))
    finally:
        code = relay and relay.stop(timeout=30)
    assert code == 0, relay.log_text()[-2000:]
    table = db.rows()
    assert all(r["status"] == "PUBLISHED" and r["attempt_count"] == 1 for r in table), \
        [(r["aggregate_id"], r["aggregate_version"], r["attempt_count"], r["last_error_code"])
         for r in table if r["attempt_count"] != 1][:10]
    audit = check_audit(db)
    assert not audit.violations, audit.violations[:10]
    assert audit.max_held["r-ahead"] == MAX_BATCHES * 100, dict(audit.max_held)
    kc, problems = check_kafka(kafka, [topic], table, dup_allowed=set())
    assert not problems, problems
    assert len(kc.ids) == len(table)
    report("1 relay, batch 100, broker stopped for a moment: %d rows, at most %d held at "
           "once (%d batches); %d messages on kafka, order ok", len(rows),
           audit.max_held["r-ahead"], MAX_BATCHES, len(kc.msgs))
