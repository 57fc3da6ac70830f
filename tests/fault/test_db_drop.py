"""Scenario 4 (G1, G2): the database connection goes away under a working
relay and sweeper: their backends are terminated (pg_terminate_backend)
several times, then PostgreSQL is restarted. Both reconnect, the relay
finishes, nothing is lost, order holds.

Broker: Apache Kafka (tests/run's). Every other termination lands while the
broker is stopped (SIGSTOP) with a batch of the relay's in flight: its
delivery reports arrive after its connection is gone."""
import contextlib

import pytest

from conftest import (check_audit, check_kafka, db_lag_s, reconnect, relay_env, sweeper_env,
                      wait_quiet)
from fixtures import own_pg  # noqa: F401  (the module's own server, as `pg`)
from harness import Relay, make_events, wait_until

TERMINATIONS = 4


def relay_backends(db):
    return db.execute("SELECT count(*) AS n FROM pg_stat_activity WHERE datname = "
                      "current_database() AND application_name LIKE 'outbox-relay:%%'")[0]["n"]


def test_database_connection_dropped(pg, db, kafka, tmp_path, report):
    if not pg.restartable:
        pytest.skip("needs OUTBOX_TEST_PG_DIR (or no OUTBOX_TEST_DATABASE_URL) to restart "
                    "PostgreSQL")
    topic = "%s.Order" % db.schema
    kafka.create_topic(topic, 4)
    rows = make_events(aggregates=100, versions=40, aggregate_type="Order")
    db.insert_events(rows)
    total = len(rows)
    relay = Relay("outbox-relay", name="r-db", log_dir=tmp_path,
                  env=relay_env(db, kafka, "r-db", OUTBOX_BATCH_SIZE=50))
    sweeper = Relay("outbox-sweeper", name="sweeper-db", log_dir=tmp_path,
                    env=sweeper_env(db, "sweeper-db", OUTBOX_LOCK_TIMEOUT_S=3))
    terminated = []
    try:
        published = lambda: db.status_counts()["PUBLISHED"]  # noqa: E731
        for i in range(TERMINATIONS):
            target = total * (i + 1) // (TERMINATIONS + 3)
            wait_until(lambda: published() >= target, 60, interval=0.02,
                       what="progress before termination %d" % (i + 1))
            # connected again after the round before (progress may have come first)
            wait_until(lambda: relay_backends(db), 30, interval=0.02,
                       what="the relay connected before termination %d" % (i + 1))
            with kafka.paused() if i % 2 == 0 else contextlib.nullcontext():
                if i % 2 == 0:
                    wait_until(lambda: db.count("status = 'PUBLISHING'"), 10, interval=0.02,
                               what="a batch in flight before termination %d" % (i + 1))
                    in_flight = db.count("status = 'PUBLISHING'")
                else:
                    in_flight = None
                n = pg.terminate_backends("outbox-relay:%")
            terminated.append((published(), in_flight, n))
            assert n >= 1, "no relay backend to terminate"
        wait_until(lambda: published() >= total * (TERMINATIONS + 1) // (TERMINATIONS + 3), 60,
                   interval=0.05, what="progress before the restart")
        at_restart = published()
        pg.restart()
        reconnect(db)
        counts = wait_quiet(db, 120, "the relay to finish after the restart")
        assert relay.running(), relay.log_text()[-3000:]
        assert sweeper.running(), sweeper.log_text()[-3000:]
        # both logged the loss and came back
        # (the rows may all be out before the lock connection's backoff ends)
        wait_until(lambda: relay.log_text().count('msg="connected"') >= TERMINATIONS + 2
                   and relay.log_text().count("database connection down") >= TERMINATIONS,
                   30, what="the relay reconnected after the restart")
        wait_until(lambda: sweeper.log_text().count('msg="connected"') >= 2, 30,
                   what="sweeper reconnected after the restart")
    finally:
        rc_relay = relay.stop()
        rc_sweeper = sweeper.stop()
    assert (rc_relay, rc_sweeper) == (0, 0)
    assert counts["PUBLISHED"] == total, counts

    table = db.rows()
    audit = check_audit(db, lock_timeout_s=3)
    assert not audit.violations, audit.violations[:10]
    resets = sum(audit.stale_resets.values())
    kc, problems = check_kafka(kafka, [topic], table, dup_allowed=audit.relocked_after_stale)
    assert not problems, problems
    assert len(kc.ids) == total
    report("%d events; %d pg_terminate_backend rounds (published so far, rows in flight with "
           "the broker stopped, backends killed): %s; "
           "restart at %d published; relay logged %d reconnections (of its three connections); sweeper reset %d stale "
           "locks; all PUBLISHED; kafka: %d messages, %d duplicates (after STALE_LOCK only), "
           "order ok; max lag %.2fs (kafka), %.2fs (table)",
           total, len(terminated), terminated, at_restart,
           relay.log_text().count('msg="connected"') - 1, resets, len(kc.msgs),
           kc.extra_copies, kc.max_lag_s, db_lag_s(db))


def test_sigterm_during_database_outage(pg, db, kafka, tmp_path, report):
    """An idle relay whose database is shut down keeps trying to reconnect. A
    SIGTERM then is still a clean stop: exit 0, nothing of its own
    PUBLISHING, and no server notice on stderr outside the log format.

    The relay polls seldom here, so no lock statement is in flight when the
    server goes: a lock whose answer the shutdown takes is a lock the relay
    cannot know it holds, and then exit 1 with the rows left to the sweeper
    is the right stop (DESIGN, "Lock statements with an unknown
    outcome")."""
    if not pg.restartable:
        pytest.skip("needs OUTBOX_TEST_PG_DIR (or no OUTBOX_TEST_DATABASE_URL) to stop "
                    "PostgreSQL")
    warm = make_events(aggregates=5, versions=1)
    db.insert_events(warm)
    relay = Relay("outbox-relay", name="r-out", log_dir=tmp_path,
                  env=relay_env(db, kafka, "r-out", OUTBOX_LOG_FORMAT="text",
                                OUTBOX_POLL_INTERVAL_MS="600000"))
    try:
        wait_until(lambda: db.status_counts()["PUBLISHED"] == len(warm), 60,
                   what="warm-up rows PUBLISHED")
        pg.stop_server()
        try:
            wait_until(lambda: "database connection down" in relay.log_text(), 30,
                       what="the relay retrying its connection")
            rc = relay.stop(timeout=60)
        finally:
            pg.start_server()
    finally:
        if relay.running():
            relay.kill()
    reconnect(db)
    log = relay.log_text()
    assert rc == 0, log[-2000:]
    assert db.count("status = 'PUBLISHING'") == 0
    stray = [ln for ln in log.splitlines() if ln.startswith("FATAL")]
    assert not stray, stray
    report("idle relay, PostgreSQL shut down, SIGTERM: exit %d, 0 PUBLISHING, no stray "
           "server notice on stderr", rc)
