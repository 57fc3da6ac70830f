"""Scenario 6 (G5): SIGTERM while a batch is in flight. The relay stops
locking, waits for the batch's delivery reports (bounded by the delivery
timeout), marks every row and exits 0, leaving no PUBLISHING row of its own.
Once with a slow broker (the batch completes), once with the broker hung past
the delivery timeout (the batch fails and is marked FAILED), once with every
broker down.

Broker: Apache Kafka (tests/run's), stopped with SIGSTOP to hold a batch in
flight; librdkafka's mock cluster (own_kafka) for "every broker down", which
refuses connections on command."""
import datetime
import signal
import time

from conftest import DELIVERY_TIMEOUT_MS, check_audit, check_kafka, relay_env
from harness import Relay, free_port, make_events, wait_until
from observe import scrape

# Beyond the delivery timeout: marking the batch and closing down.
GRACE_S = 2.0


def sigterm_in_flight(db, kafka, tmp_path, rid, relay=None, resume_after=None, produced=None):
    """Starts a relay (unless given), waits until it holds a batch (and, given
    `produced`, until that predicate says rows went to the producer),
    SIGTERMs it; returns (exit code, seconds to exit, rows it held, wall time
    of the signal, relay). With resume_after, the (paused) broker `kafka` is
    resumed that many seconds after the signal."""
    relay = relay or Relay("outbox-relay", name=rid, log_dir=tmp_path,
                           env=relay_env(db, kafka, rid, OUTBOX_BATCH_SIZE=500))
    try:
        held = wait_until(lambda: db.count("status = 'PUBLISHING' AND locked_by = %s", (rid,)),
                          30, interval=0.01, what="%s holding a batch" % rid)
        if produced is not None:
            wait_until(produced, 10, interval=0.05, what="%s producing its batch" % rid)
        sent_wall = datetime.datetime.now(datetime.timezone.utc)
        t0 = time.monotonic()
        relay.send_signal(signal.SIGTERM)
        if resume_after is not None:
            time.sleep(resume_after)  # how long the broker stays away is the variable
            kafka.resume(1)
        rc = relay.wait(DELIVERY_TIMEOUT_MS / 1000 + 30)
        return rc, time.monotonic() - t0, held, sent_wall, relay
    finally:
        if relay.running():
            relay.kill()


def locks_after(db, rid, when):
    # by the locking statement's start (xact_ts), not by when its trigger ran
    # (ts): a lock sent just before the signal may update its rows later
    return db.execute("SELECT count(*) AS n FROM %s.lock_audit WHERE new_status = 'PUBLISHING' "
                      "AND new_locked_by = %%s AND xact_ts > %%s" % db.schema,
                      (rid, when + datetime.timedelta(seconds=0.1)))[0]["n"]


def warm_relay(db, kafka, tmp_path, rid, **env):
    """A relay that has published a few rows (connected, with its producer id)."""
    warm = make_events(aggregates=10, versions=1, aggregate_type="Order", id_prefix="w")
    db.insert_events(warm)
    relay = Relay("outbox-relay", name=rid, log_dir=tmp_path,
                  env=relay_env(db, kafka, rid, OUTBOX_BATCH_SIZE=500, **env))
    wait_until(lambda: db.status_counts()["PUBLISHED"] == len(warm), 30, what="warm-up")
    return relay


def test_sigterm_during_slow_batch(db, kafka, tmp_path, report):
    topic = "%s.Order" % db.schema
    kafka.create_topic(topic, 4)
    port = free_port()
    relay = warm_relay(db, kafka, tmp_path, "r-term", OUTBOX_HTTP_ADDR="127.0.0.1:%d" % port)
    # The broker stops answering for a while: the batch stays in flight, and
    # completes once it resumes, within the delivery timeout. The signal comes
    # once the producer holds rows (librdkafka's statistics, every second), not
    # between the lock and the fetch.
    with kafka.paused():
        db.insert_events(make_events(aggregates=400, versions=5, aggregate_type="Order"))
        rc, took, held, sent, relay = sigterm_in_flight(
            db, kafka, tmp_path, "r-term", relay, resume_after=1.0,
            produced=lambda: scrape(port).total("outbox_kafka_queue_messages") > 0)
    assert rc == 0, relay.log_text()[-2000:]
    assert took < DELIVERY_TIMEOUT_MS / 1000 + GRACE_S, took
    assert db.count("status = 'PUBLISHING'") == 0
    assert locks_after(db, "r-term", sent) == 0, "locked rows after SIGTERM"
    c = db.status_counts()
    table = db.rows()
    audit = check_audit(db)
    assert not audit.violations, audit.violations[:10]
    # every held row was marked, or given back unattempted (a later version whose
    # turn in the batch had not come when the signal arrived)
    released = audit.releases[("relay", "RELEASED")]
    assert c["PUBLISHED"] > 10 and c["PUBLISHED"] + c["FAILED"] + released >= held, \
        (c, released, held)
    kc, problems = check_kafka(kafka, [topic], table, dup_allowed=set())
    assert not problems, problems
    report("broker stopped 1s: SIGTERM with %d rows held -> exit %d after %.2fs "
           "(delivery timeout %.1fs); 0 PUBLISHING left, no lock after the signal; %d "
           "PUBLISHED, all on kafka (%d messages, 0 duplicates)", held, rc, took,
           DELIVERY_TIMEOUT_MS / 1000, c["PUBLISHED"], len(kc.msgs))


def test_sigterm_with_broker_hung(db, kafka, tmp_path, report):
    topic = "%s.Order" % db.schema
    kafka.create_topic(topic, 4)
    relay = warm_relay(db, kafka, tmp_path, "r-hung")
    with kafka.paused():
        db.insert_events(make_events(aggregates=300, versions=2, aggregate_type="Order",
                                     id_prefix="d"))
        rc, took, held, sent, relay = sigterm_in_flight(db, kafka, tmp_path, "r-hung", relay)
    check_failed_batch(db, relay, rc, took, held, sent, report, "broker hung (SIGSTOP)")
    # What the hung broker had read before it stopped may still land: every
    # PUBLISHED row is on Kafka, and nothing else is.
    kc, problems = check_kafka(kafka, [topic], db.rows(), dup_allowed=set())
    assert not problems, problems


def check_failed_batch(db, relay, rc, took, held, sent, report, what):
    """After a SIGTERM whose batch could not be delivered: exit 0 in time, the
    batch's first versions FAILED with a backoff, the later ones given back."""
    rid = relay.name
    assert rc == 0, relay.log_text()[-2000:]
    assert took < DELIVERY_TIMEOUT_MS / 1000 + GRACE_S, \
        "exit took %.2fs with a %.1fs delivery timeout" % (took, DELIVERY_TIMEOUT_MS / 1000)
    assert db.count("status = 'PUBLISHING'") == 0
    assert locks_after(db, rid, sent) == 0, "locked rows after SIGTERM"
    failed = db.rows(where="status = 'FAILED'")
    audit = check_audit(db)
    assert not audit.violations, audit.violations[:10]
    # the batch's first versions failed; later versions of the same aggregates in the
    # batch were given back unattempted (PENDING, attempt_count 0)
    released = db.rows(where="status = 'PENDING' AND attempt_count = 0 AND aggregate_id LIKE 'd%%'")
    released = [r for r in released if audit.unattempted[r["outbox_id"]]]
    # every row it locked in this phase (the first locks after a start are
    # small and grow, so more may come after `held` was read, never after the
    # signal) ended FAILED or given back
    d_rows = {r["outbox_id"] for r in db.rows(where="aggregate_id LIKE 'd%%'")}
    locked = sum(1 for oid in audit.locks if oid in d_rows)
    assert locked >= held
    assert len(failed) + len(released) == locked, (len(failed), len(released), locked, held)
    assert all(r["last_error_code"] for r in failed)
    # the backoff counts from the marking transaction's start (now()), not from
    # the row's updated_at (clock_timestamp(), later by the statement's time)
    failed_ids = {r["outbox_id"] for r in failed}
    marks = [a for a in audit.failed if str(a["outbox_id"]) in failed_ids]
    assert len(marks) >= len(failed) and all(a["available_at"] > a["xact_ts"] for a in marks), \
        marks[:3]
    report("%s: SIGTERM with %d rows held -> exit %d after %.2fs (delivery timeout "
           "%.1fs); %d FAILED (%s) with a future available_at, %d given back unattempted, "
           "0 PUBLISHING", what, held, rc, took, DELIVERY_TIMEOUT_MS / 1000, len(failed),
           sorted({r["last_error_code"] for r in failed}), len(released))


def test_sigterm_with_broker_down(db, own_kafka, tmp_path, report):
    kafka = own_kafka
    topic = "%s.Order" % db.schema
    kafka.create_topic(topic, 4)
    # A relay that was publishing (producer id, connections) loses its broker.
    relay = warm_relay(db, kafka, tmp_path, "r-down")
    kafka.down()
    db.insert_events(make_events(aggregates=300, versions=2, aggregate_type="Order",
                                 id_prefix="d"))
    rc, took, held, sent, relay = sigterm_in_flight(db, kafka, tmp_path, "r-down", relay)
    kafka.up()
    check_failed_batch(db, relay, rc, took, held, sent, report, "every broker down (mock)")
