"""Scenario 2 (G1, G2, G3): a relay SIGKILLed again and again while it
publishes; the sweeper (3 s lock timeout) returns the locks it held; a last
relay finishes, while a writer commits most events in transactions out of
version order on purpose. Nothing is lost, order holds, and an event is on
Kafka twice only if its row was locked again after a STALE_LOCK reset.

Broker: Apache Kafka (tests/run's). Every other kill lands while the broker is
stopped (SIGSTOP) after the victim locked: its batch is then surely produced
and unacknowledged, and whatever it had sent is appended once the broker
resumes, after the victim is gone."""
import contextlib
import signal
import threading
import time

from conftest import (check_audit, check_kafka, db_lag_s, relay_env, sweeper_env,
                      wait_quiet, write_out_of_order)
from harness import Relay, make_events, wait_until

LOCK_TIMEOUT_S = 3
# Seconds between the victim's first lock and its SIGKILL: from "right after
# locking its first batch" to "deep into its work"; with the broker stopped
# meanwhile (True) or working.
KILL_DELAYS = ((0.0, True), (0.08, False), (0.2, True), (0.02, False), (0.6, True),
               (0.0, False), (1.0, True), (0.05, False), (0.4, True), (0.12, False))
MID_BATCH_KILLS = 5  # kills that must leave locks behind


def locks_by(db, relay_id):
    return db.execute("SELECT count(*) AS n FROM %s.lock_audit WHERE new_status = 'PUBLISHING'"
                      " AND new_locked_by = %%s" % db.schema, (relay_id,))[0]["n"]


def backends(db, relay_id):
    """Sessions of relay `relay_id` (application_name outbox-relay:<connection>:<id>):
    the modules running beside this one have relays on the same database."""
    return db.execute("SELECT count(*) AS n FROM pg_stat_activity WHERE datname = "
                      "current_database() AND application_name LIKE %s",
                      ("outbox-relay:%:" + relay_id,))[0]["n"]


def test_sigkill_during_publishing(db, kafka, tmp_path, report):
    topic = "%s.Order" % db.schema
    kafka.create_topic(topic, 4)
    rows = make_events(aggregates=150, versions=40, aggregate_type="Order")
    half = len(rows) // 10
    db.insert_events(rows[:half])
    # The rest comes while the kills go on, from a writer whose
    # transactions commit out of version order on purpose.
    pairs = []
    writer = threading.Thread(target=lambda: pairs.append(
        write_out_of_order(db, rows[half:], chunk=300, delay=0.5, pause=0.3)))
    writer.start()
    sweeper = Relay("outbox-sweeper", name="sweeper-1", log_dir=tmp_path,
                    env=sweeper_env(db, "sweeper-1", OUTBOX_LOCK_TIMEOUT_S=LOCK_TIMEOUT_S))
    kills = []
    started = []  # every relay of the test, killed in `finally` if a check failed
    try:
        for k, (delay, hung) in enumerate(KILL_DELAYS, 1):
            rid = "victim-%d" % k
            victim = Relay("outbox-relay", name=rid, log_dir=tmp_path,
                           env=relay_env(db, kafka, rid, OUTBOX_BATCH_SIZE=100))
            started.append(victim)
            wait_until(lambda: locks_by(db, rid) > 0 or not victim.running(), 30, interval=0.02,
                       what="%s locking rows" % rid)
            assert victim.running(), victim.log_text()[-2000:]
            with kafka.paused() if hung else contextlib.nullcontext():
                time.sleep(delay)  # the moment of the kill is the variable under test
                assert victim.kill() == -signal.SIGKILL
            # A statement the victim had sent still runs to its end (a mark may
            # commit after the kill): count what is left once its backends are gone.
            wait_until(lambda: backends(db, rid) == 0, 30, interval=0.02,
                       what="%s's backends gone" % rid)
            orphans = db.count("status = 'PUBLISHING' AND locked_by = %s", (rid,))
            kills.append((rid, delay, "hung" if hung else "up", locks_by(db, rid), orphans))
            if sum(1 for x in kills if x[4] > 0) >= MID_BATCH_KILLS or \
                    db.status_counts()["PUBLISHED"] > len(rows) * 0.8:
                break  # enough, and keep work for the survivors
        writer.join(60)
        assert not writer.is_alive() and pairs, "the writer did not finish"
        final = Relay("outbox-relay", name="final", log_dir=tmp_path,
                      env=relay_env(db, kafka, "final", OUTBOX_BATCH_SIZE=100))
        started.append(final)
        counts = wait_quiet(db, 120, "the final relay to finish after the kills")
        assert final.stop() == 0
        assert sweeper.running(), sweeper.log_text()[-2000:]
    finally:
        for r in started:
            if r.running():
                r.kill()
        sweeper_rc = sweeper.stop()
    assert sweeper_rc == 0

    killed_mid_batch = [k for k in kills if k[4] > 0]
    assert len(killed_mid_batch) >= MID_BATCH_KILLS, ("kills should leave locks behind", kills)
    assert counts["PUBLISHED"] == len(rows), counts

    table = db.rows()
    audit = check_audit(db, lock_timeout_s=LOCK_TIMEOUT_S)
    assert not audit.violations, audit.violations[:10]
    orphaned = sum(k[4] for k in kills)
    resets = sum(audit.stale_resets.values())
    assert resets >= orphaned, (resets, orphaned)
    assert all(r["attempt_count"] == audit.locks[r["outbox_id"]] - audit.unattempted[r["outbox_id"]]
               for r in table)

    kc, problems = check_kafka(kafka, [topic], table, dup_allowed=audit.relocked_after_stale)
    assert not problems, problems
    assert len(kc.ids) == len(rows)
    report("%d events (9/10 from a writer committing %d transaction pairs in reverse version "
           "order); %d SIGKILLs (victim, delay s, broker, rows locked, locks left): %s; "
           "sweeper reset %d stale locks, %d rows re-locked after a reset; all PUBLISHED; "
           "kafka: %d messages, %d distinct, %d duplicate copies of %d events (all re-locked "
           "after STALE_LOCK); order ok; max lag %.2fs (kafka), %.2fs (table)",
           len(rows), pairs[0], len(kills), kills, resets, len(audit.relocked_after_stale),
           len(kc.msgs), len(kc.ids), kc.extra_copies, len(kc.dups), kc.max_lag_s,
           db_lag_s(db))
