"""Memory is bounded by bytes, not rows: OUTBOX_BATCH_BYTES caps what a relay
holds, so rows with large payloads come
a few at a time, and one row larger than the budget still goes out alone. The
lock audit tells how many rows a relay held at once; Apache Kafka gets every
row, in order."""
from conftest import check_audit, check_kafka, relay_env
from harness import Relay, wait_until

ROW_PAYLOAD = 200_000  # bytes of each row's payload text
BUDGET = 1_048_576
FIRST_LOCK_ROWS = 16  # relay.c LOCK_FIRST_ROWS


def big_rows(n, aggregates, pad=ROW_PAYLOAD, prefix="big"):
    rows = []
    for i in range(n):
        rows.append({"aggregate_type": "Order", "aggregate_id": "%s%d" % (prefix, i % aggregates),
                     "aggregate_version": i // aggregates + 1, "event_type": "E",
                     "payload_json": {"i": i, "pad": "x" * pad}})
    return rows


def test_batches_are_bounded_by_bytes(db, kafka, tmp_path, report):
    topic = "%s.Order" % db.schema
    kafka.create_topic(topic, 4, config={"max.message.bytes": 3_000_000})
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
    # A lock takes no more rows than fit in what is left of the budget at
    # the rows' learnt size, counting the rows held (fetched or not): at most
    # budget / row + 1 rows held at once, except the relay's first lock, which
    # cannot know the rows' size yet and takes at most FIRST_LOCK_ROWS.
    most = audit.max_held["r-bytes"]
    assert most <= max(FIRST_LOCK_ROWS, BUDGET // ROW_PAYLOAD + 1), most
    assert most >= 2  # the budget still lets several rows go together
    kc, problems = check_kafka(kafka, [topic], db.rows(), dup_allowed=set())
    assert not problems, problems
    assert huge in kc.ids
    report("61 rows of 200 kB (one of 1.5 MB), OUTBOX_BATCH_BYTES=1 MiB: at most %d rows held "
           "at once (budget allows %d + 1); all on Kafka, in order", most,
           BUDGET // ROW_PAYLOAD)
