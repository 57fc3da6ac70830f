"""Memory is bounded by bytes, not rows: OUTBOX_BATCH_BYTES caps what a relay
holds, so rows with large payloads come
a few at a time, and one row larger than the budget still goes out alone.
Apache Kafka gets every row, in order.

How many rows' content the relay held at once is counted from outside: a row
holds content from its lock (the lock audit's timestamp) until Kafka appended
it (LogAppendTime on this machine's clock). After that it only waits for its
mark, which holds no content, so rows awaiting their mark are not counted."""
from conftest import audit_rows, check_audit, check_kafka, relay_env
from harness import Relay, header, wait_until

ROW_PAYLOAD = 200_000  # bytes of each row's payload text
BUDGET = 1_048_576
FIRST_LOCK_ROWS = 16  # relay.c LOCK_FIRST_ROWS
# What may hold a row's content at once (docs/DESIGN.md, Memory): the relay,
# rows fetched and not produced, within the budget plus the row that crosses
# it; and the producer's queue, queue.buffering.max.kbytes = 2 x the budget
# + 1 MiB (common/kafka.c).
RELAY_ROWS = BUDGET // ROW_PAYLOAD + 1
PRODUCER_ROWS = (2 * BUDGET + 1_048_576) // ROW_PAYLOAD


def big_rows(n, aggregates, pad=ROW_PAYLOAD, prefix="big"):
    rows = []
    for i in range(n):
        rows.append({"aggregate_type": "Order", "aggregate_id": "%s%d" % (prefix, i % aggregates),
                     "aggregate_version": i // aggregates + 1, "event_type": "E",
                     "payload_json": {"i": i, "pad": "x" * pad}})
    return rows


def test_batches_are_bounded_by_bytes(db, kafka, tmp_path, report):
    topic = "%s.Order" % db.schema
    kafka.create_topic(topic, 4, config={"max.message.bytes": 3_000_000,
                                         "message.timestamp.type": "LogAppendTime"})
    db.insert_events(big_rows(60, aggregates=20))
    # one row over the budget: it goes out alone
    (huge,) = db.insert_events([{"aggregate_type": "Order", "aggregate_id": "huge",
                                 "aggregate_version": 1, "event_type": "E",
                                 "payload_json": {"pad": "y" * 1_500_000}}])
    env = relay_env(db, kafka, "r-bytes", OUTBOX_BATCH_BYTES=BUDGET,
                    OUTBOX_KAFKA_MESSAGE_MAX_BYTES=2_000_000)
    with Relay("outbox-relay", name="r-bytes", log_dir=tmp_path, env=env) as relay:
        wait_until(lambda: db.status_counts()["PUBLISHED"] == 61, 60, what="all rows PUBLISHED")
        assert relay.stop() == 0
    audit = check_audit(db)
    assert not audit.violations, audit.violations[:10]
    kc, problems = check_kafka(kafka, [topic], db.rows(), dup_allowed=set())
    assert not problems, problems
    assert huge in kc.ids
    # A lock takes no more rows than fit in what is left of the budget at
    # the rows' learnt size, counting the rows held (fetched or not), except
    # the relay's first lock, which cannot know the rows' size yet and takes
    # at most FIRST_LOCK_ROWS. A relay that ignored the budget would lock 16
    # and then 64 rows: all 61 at once.
    most, when = held_with_content(audit_rows(db), kc.msgs)
    report("61 rows of 200 kB (one of 1.5 MB), OUTBOX_BATCH_BYTES=1 MiB: at most %d rows locked "
           "and not yet on Kafka at once (at %s; bound max(%d, %d relay + %d producer queue)); "
           "at most %d locked and not marked; all on Kafka, in order", most, when,
           FIRST_LOCK_ROWS, RELAY_ROWS, PRODUCER_ROWS, audit.max_held["r-bytes"])
    assert most <= max(FIRST_LOCK_ROWS, RELAY_ROWS + PRODUCER_ROWS), (most, when)
    assert most >= 2  # the budget still lets several rows go together


def held_with_content(audit, msgs):
    """The most rows locked and not yet appended to Kafka at any lock's
    moment, and that moment: (count, timestamp)."""
    appended = {}
    for m in msgs:
        eid, t = header(m, "event-id"), m["timestamp"] / 1e3
        appended[eid] = min(appended.get(eid, t), t)
    locked = {}
    for r in audit:
        if r["new_status"] == "PUBLISHING" and r["outbox_id"] not in locked:
            locked[r["outbox_id"]] = r["xact_ts"].timestamp()
    assert set(locked) <= set(appended), "a locked row never reached Kafka"
    most = (0, None)
    for t in sorted(set(locked.values())):
        n = sum(1 for oid, lt in locked.items() if lt <= t < appended[oid])
        most = max(most, (n, t))
    return most
