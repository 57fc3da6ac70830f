"""Scenario 3 (G1, G2): every broker down for longer than the delivery timeout,
then up. Rows go FAILED with a Kafka error code and a future available_at
(exponential backoff with jitter, docs/DESIGN.md step 4), then PUBLISHED; the
relay does not spin while the broker is away.

Broker: librdkafka's mock cluster (own_kafka) for "every broker down": it
refuses connections on command and comes back at once, which the backoff
timings and /readyz checks here rely on. Apache Kafka brokers going down,
hanging and failing over are in test_cluster.py; a hung Apache Kafka broker
holds the batch in flight in test_row_updated_in_flight_is_still_marked."""
import time

from conftest import (DELIVERY_TIMEOUT_MS, check_audit, check_kafka, cpu_seconds, db_lag_s,
                      relay_env, wait_quiet, wait_with_producer)
from harness import Relay, http_status, free_port, make_events, wait_until

BACKOFF_INITIAL_MS = 1000
BACKOFF_MAX_MS = 4000
DOWN_S = 11  # > 3 delivery timeouts of 3 s


readyz = http_status  # the endpoint these tests watch is /readyz


def expected_backoff_ms(attempt):
    return min(BACKOFF_INITIAL_MS * 2 ** (attempt - 1), BACKOFF_MAX_MS)


def warm_relay_broker_down(db, kafka, tmp_path, name, env):
    """Starts a relay, lets it publish a few rows (connected, with its
    producer id), then takes every broker down. Returns (relay, warm-up rows);
    the caller stops the relay (`with relay:`)."""
    warm = make_events(aggregates=5, versions=1, id_prefix="w")
    db.insert_events(warm)
    relay = Relay("outbox-relay", name=name, log_dir=tmp_path, env=env)
    try:
        wait_until(lambda: db.status_counts()["PUBLISHED"] == len(warm), 60,
                   what="warm-up rows PUBLISHED")
        kafka.down()
    except BaseException:
        relay.stop()
        raise
    return relay, warm


def test_broker_down_then_up(db, own_kafka, tmp_path, report):
    kafka = own_kafka
    topic = "%s.Order" % db.schema
    kafka.create_topic(topic, 4)
    port = free_port()
    env = relay_env(db, kafka, "r-down", OUTBOX_BATCH_SIZE=100, OUTBOX_MAX_ATTEMPTS=50,
                    OUTBOX_BACKOFF_INITIAL_MS=BACKOFF_INITIAL_MS,
                    OUTBOX_BACKOFF_MAX_MS=BACKOFF_MAX_MS,
                    OUTBOX_HTTP_ADDR="127.0.0.1:%d" % port)
    before = make_events(aggregates=50, versions=2, id_prefix="b")
    db.insert_events(before)
    with Relay("outbox-relay", name="r-down", log_dir=tmp_path, env=env) as relay:
        wait_until(lambda: db.status_counts()["PUBLISHED"] == len(before), 60,
                   what="warm-up rows PUBLISHED")
        wait_until(lambda: readyz(port) == 200, 10, what="/readyz 200 with the broker up")

        kafka.down()
        down_at = time.monotonic()
        during = make_events(aggregates=50, versions=4, id_prefix="b")[len(before):]
        during += make_events(aggregates=50, versions=2, id_prefix="d")
        during_ids = set(db.insert_events(during))

        first = wait_until(lambda: db.rows(where="status = 'FAILED'"), DELIVERY_TIMEOUT_MS / 1000 + 10,
                           what="rows FAILED while the broker is down")
        for r in first:
            assert r["last_error_code"], r
            assert r["available_at"] > r["updated_at"], ("available_at not in the future", r)
            assert r["locked_by"] is None and r["attempt_count"] == 1
        codes_first = sorted({r["last_error_code"] for r in first})
        ready_down = wait_until(lambda: [c for c in [readyz(port)] if c != 200], 10,
                                what="/readyz not 200 with the broker down")[0]

        # CPU over the rest of the outage: timeouts, backoffs and polls, no spinning.
        cpu0, t0 = cpu_seconds(relay.pid), time.monotonic()
        time.sleep(max(0.0, DOWN_S - (t0 - down_at)))
        cpu_share = (cpu_seconds(relay.pid) - cpu0) / (time.monotonic() - t0)
        assert db.count("status = 'PUBLISHED' AND outbox_id = ANY(%s::uuid[])",
                        (list(during_ids),)) == 0, "published with every broker down?"
        kafka.up()
        up_at = time.monotonic()
        counts = wait_quiet(db, 60, "all rows PUBLISHED after the broker came back")
        recovered_s = time.monotonic() - up_at
        wait_until(lambda: readyz(port) == 200, 10, what="/readyz 200 again")
        assert relay.stop() == 0
    assert counts["PUBLISHED"] == len(before) + len(during), counts
    assert cpu_share < 0.25, "relay used %.0f%% CPU with the broker down" % (cpu_share * 100)

    table = db.rows()
    audit = check_audit(db)
    assert not audit.violations, audit.violations[:10]
    assert all(r["attempt_count"] == audit.locks[r["outbox_id"]] - audit.unattempted[r["outbox_id"]]
               for r in table)
    retried = [r for r in table if r["outbox_id"] in during_ids and r["attempt_count"] >= 2]
    assert retried, "rows of the outage were retried"
    max_attempts = max(r["attempt_count"] for r in table)
    assert max_attempts >= 3, "broker down for %ds: expected >= 3 attempts" % DOWN_S

    # Backoff of every FAILED mark: available_at - mark time in [d/2, d], d =
    # initial * 2^(attempt-1) capped at max; and no lock before available_at.
    backoffs = {}
    codes = set()
    due_at = {}
    for a in db.execute("SELECT *, outbox_id::text AS outbox_id FROM %s.lock_audit ORDER BY seq"
                        % db.schema):
        if a["new_status"] == "FAILED":
            assert a["code"] and a["code"] != "STALE_LOCK", a
            codes.add(a["code"])
            delay_ms = (a["available_at"] - a["ts"]).total_seconds() * 1000
            d = expected_backoff_ms(a["attempt_count"])
            assert d / 2 - 300 <= delay_ms <= d + 5, (a["attempt_count"], delay_ms, d)
            backoffs.setdefault(a["attempt_count"], []).append(delay_ms)
            due_at[a["outbox_id"]] = a["available_at"]
        elif a["new_status"] == "PUBLISHING" and a["outbox_id"] in due_at:
            early = (due_at.pop(a["outbox_id"]) - a["ts"]).total_seconds()
            assert early < 0.05, "locked %.3fs before available_at" % early

    dup_ok = {oid for oid, n in audit.locks.items() if n > 1}
    kc, problems = check_kafka(kafka, [topic], table, dup_allowed=dup_ok)
    assert not problems, problems
    assert len(kc.ids) == len(table)
    report("broker down %ds (delivery timeout %dms): first FAILED codes %s, all codes %s; "
           "/readyz %d while down; relay CPU %.1f%% while down; %d rows retried, max "
           "attempt_count %d; backoff ms by attempt %s; all %d PUBLISHED %.1fs after up; "
           "kafka: %d messages, %d duplicates (retried rows only), order ok; max lag %.2fs "
           "(kafka), %.2fs (table)",
           DOWN_S, DELIVERY_TIMEOUT_MS, codes_first, sorted(codes), ready_down,
           cpu_share * 100, len(retried), max_attempts,
           {k: "%d-%d" % (min(v), max(v)) for k, v in sorted(backoffs.items())},
           len(table), recovered_s, len(kc.msgs), kc.extra_copies, kc.max_lag_s, db_lag_s(db))


def touched_while_stopped(db, kafka, relay, port, rows, produced):
    """Inserts rows while Apache Kafka is stopped (SIGSTOP); once the relay
    has locked them all and `produced` of them are with its producer
    (librdkafka's statistics, each second), an operator updates them all (any
    UPDATE moves a row to a new ctid); then Kafka goes on. Waits for every row
    to be final and stops the relay: (status counts, the relay's log)."""
    with kafka.paused():
        ids = db.insert_events(rows)
        wait_until(lambda: db.count("status = 'PUBLISHING' AND outbox_id = ANY(%s::uuid[])",
                                    (ids,)) == len(ids), 30, what="the rows locked")
        wait_with_producer(port, produced, "%d rows in the producer's queue" % produced)
        db.execute("SELECT set_config('outbox.actor', 'operator', false)")
        db.execute("UPDATE %s SET trace_id = 'touched' WHERE outbox_id = ANY(%%s::uuid[])"
                   % db.table, (ids,))
    counts = wait_quiet(db, 60, "the touched rows PUBLISHED")
    assert relay.stop() == 0
    return counts, relay.log_text()


def published_once(db, kafka, topic):
    """Every row PUBLISHED on its first attempt, a clean lock audit, and each
    event once on Kafka, in version order (G1, G2)."""
    table = db.rows()
    assert all(r["attempt_count"] == 1 for r in table), \
        [(r["outbox_id"], r["attempt_count"]) for r in table if r["attempt_count"] != 1]
    audit = check_audit(db)
    assert not audit.violations, audit.violations[:10]
    kc, problems = check_kafka(kafka, [topic], table, dup_allowed=set())
    assert not problems, problems
    assert len(kc.ids) == len(table)


def test_row_updated_in_flight_is_still_marked(db, kafka, tmp_path, report):
    """The mark finds a batch's rows by the ctid the lock returned. A row
    that something else updated in the meantime (any UPDATE moves it to a new
    ctid: here an operator touching trace_id while the broker hangs) must
    still be marked PUBLISHED by its relay, through the outbox_id fallback:
    no lost lock, no second attempt. Apache Kafka, stopped (SIGSTOP) while
    the rows are in flight: locked, fetched and with the producer (the fetch
    reads rows by that ctid too, and has no such fallback)."""
    topic = "%s.Order" % db.schema
    kafka.create_topic(topic, 4)
    port = free_port()
    env = relay_env(db, kafka, "r-moved", OUTBOX_KAFKA_DELIVERY_TIMEOUT_MS=60000,
                    OUTBOX_HTTP_ADDR="127.0.0.1:%d" % port)
    warm = make_events(aggregates=5, versions=1, id_prefix="w")
    db.insert_events(warm)
    with Relay("outbox-relay", name="r-moved", log_dir=tmp_path, env=env) as relay:
        wait_until(lambda: db.status_counts()["PUBLISHED"] == len(warm), 60,
                   what="warm-up rows PUBLISHED")
        rows = make_events(aggregates=20, versions=1, id_prefix="m")
        counts, log = touched_while_stopped(db, kafka, relay, port, rows, produced=len(rows))
    assert counts["PUBLISHED"] == len(warm) + len(rows), counts
    assert "locks lost" not in log, log[-2000:]
    published_once(db, kafka, topic)
    report("%d rows updated by an operator while in flight (Apache Kafka stopped): all "
           "PUBLISHED on their first attempt, no lock lost, every event once on Kafka",
           len(rows))


def test_rows_moved_before_their_fetch_are_read_by_id(db, kafka, tmp_path, report):
    """A row's content is read by the ctid its lock returned. A row that an
    UPDATE moved between its lock and that read (an operator touching
    trace_id here; a table rewrite moves every row) is read by its outbox_id
    instead: PUBLISHED on its first attempt, not left PUBLISHING until a
    sweeper takes the lock back. The rows are large and OUTBOX_BATCH_BYTES
    small, so with Apache Kafka stopped (SIGSTOP) the producer's queue is
    full after a row or two and the others stay locked and unread."""
    topic = "%s.Order" % db.schema
    kafka.create_topic(topic, 4)
    port = free_port()
    env = relay_env(db, kafka, "r-unread", OUTBOX_BATCH_BYTES=65536,
                    OUTBOX_KAFKA_DELIVERY_TIMEOUT_MS=60000,
                    OUTBOX_HTTP_ADDR="127.0.0.1:%d" % port)
    warm = make_events(aggregates=2, versions=1, id_prefix="w")
    db.insert_events(warm)
    with Relay("outbox-relay", name="r-unread", log_dir=tmp_path, env=env) as relay:
        wait_until(lambda: db.status_counts()["PUBLISHED"] == len(warm), 60,
                   what="warm-up rows PUBLISHED")
        rows = [{"aggregate_type": "Order", "aggregate_id": "big%d" % a,
                 "aggregate_version": v, "event_type": "E",
                 "payload_json": {"v": v, "pad": "x" * 600_000}}
                for v in (1, 2, 3) for a in range(4)]
        # a row with the producer, whose queue (2 x OUTBOX_BATCH_BYTES + 1 MiB)
        # takes no second one: the others locked and not read
        counts, log = touched_while_stopped(db, kafka, relay, port, rows, produced=1)
    assert counts["PUBLISHED"] == len(warm) + len(rows), counts
    # the case under test happened: rows locked and not yet read were moved
    assert "reading them by outbox_id" in log, log[-2000:]
    published_once(db, kafka, topic)
    report("%d rows of 600 kB locked and not yet read when an operator updated them (Apache "
           "Kafka stopped, OUTBOX_BATCH_BYTES=64 KiB): read by outbox_id, all PUBLISHED on "
           "their first attempt, every event once on Kafka, in order", len(rows))


def test_versions_after_a_failed_one_go_back_unattempted(db, own_kafka, tmp_path, report):
    """The relay locks more batches while some are in flight, and an
    aggregate's versions in one batch go out one after the other. With the
    broker down, version 1 of each aggregate waits out the delivery timeout
    and fails: version 2, never produced, goes back unattempted (its attempt
    not counted) and is locked again later, behind version 1's retry.
    Nothing is lost, and order holds."""
    kafka = own_kafka
    topic = "%s.Order" % db.schema
    kafka.create_topic(topic, 4)
    env = relay_env(db, kafka, "r-ahead", OUTBOX_BATCH_SIZE=100, OUTBOX_MAX_ATTEMPTS=50,
                    OUTBOX_KAFKA_DELIVERY_TIMEOUT_MS=7000)
    relay, warm = warm_relay_broker_down(db, kafka, tmp_path, "r-ahead", env)
    with relay:
        rows = make_events(aggregates=300, versions=2, id_prefix="a")
        db.insert_events(rows)
        wait_until(lambda: check_audit(db).releases[("relay", "RELEASED")] > 0, 30,
                   what="versions given back while the broker is down")
        kafka.up()
        counts = wait_quiet(db, 90, "all rows PUBLISHED after the broker came back")
        assert relay.stop() == 0
        log = relay.log_text()
    assert counts["PUBLISHED"] == len(warm) + len(rows), counts
    assert "events failed, will retry" in log

    table = db.rows()
    audit = check_audit(db)
    assert not audit.violations, audit.violations[:10]
    assert all(r["attempt_count"] == audit.locks[r["outbox_id"]] - audit.unattempted[r["outbox_id"]]
               for r in table)
    released = audit.releases[("relay", "RELEASED")]
    assert released >= 100, audit.releases
    dup_ok = {oid for oid, n in audit.locks.items() if n > 1}
    kc, problems = check_kafka(kafka, [topic], table, dup_allowed=dup_ok)
    assert not problems, problems
    assert len(kc.ids) == len(table)
    report("broker down past a 7s delivery timeout: %d versions went back unattempted "
           "(attempt_count restored); all %d PUBLISHED after up; kafka: %d messages, order ok",
           released, len(table), len(kc.msgs))
