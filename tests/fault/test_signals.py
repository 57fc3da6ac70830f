"""Signals an operator or a platform sends (docs/DESIGN.md, "Exit codes and
signals"): SIGHUP, SIGUSR1 and SIGUSR2 never stop a daemon (SIGUSR1/SIGUSR2
switch debug logging on and off); a second SIGTERM exits at once, after one
line saying how many rows it leaves PUBLISHING. The mock cluster is used where
a broker must go down on command (the relay then waits on its batch)."""
import re
import signal
import time

from conftest import relay_env, sweeper_env, wait_with_producer
from harness import Relay, free_port, make_events, wait_until


def test_hup_usr1_usr2_keep_relay_and_sweeper_running(db, kafka, tmp_path, report):
    topic = "%s.Order" % db.schema
    kafka.create_topic(topic, 4)
    relay = Relay("outbox-relay", name="r-sig", log_dir=tmp_path,
                  env=relay_env(db, kafka, "r-sig"))
    sweeper = Relay("outbox-sweeper", name="sweeper-sig", log_dir=tmp_path,
                    env=sweeper_env(db, "sweeper-sig", OUTBOX_LOG_LEVEL="info"))
    with relay, sweeper:
        relay.wait_log(r'msg="started"', 20)
        sweeper.wait_log(r'msg="started"', 20)
        for proc in (relay, sweeper):
            proc.send_signal(signal.SIGHUP)
            proc.wait_log(r"SIGHUP ignored", 10)
        # debug on: the relay's per-batch debug line appears for new rows
        relay.send_signal(signal.SIGUSR1)
        relay.wait_log(r"log level debug", 10)
        db.insert_events(make_events(aggregates=5, aggregate_type="Order", id_prefix="a"))
        relay.wait_log(r'level=debug .*msg="batch done"', 20)
        # debug off again: later batches write no debug line
        relay.send_signal(signal.SIGUSR2)
        relay.wait_log(r"log level restored", 10)
        debug_lines = relay.log_text().count("level=debug")
        db.insert_events(make_events(aggregates=5, aggregate_type="Order", id_prefix="b"))
        wait_until(lambda: db.status_counts()["PUBLISHED"] == 10, 30, what="all PUBLISHED")
        sweeper.send_signal(signal.SIGUSR1)
        sweeper.wait_log(r"log level debug", 10)
        sweeper.wait_log(r'level=debug .*msg="sweep done"', 20)
        assert relay.running() and sweeper.running()
        assert relay.log_text().count("level=debug") == debug_lines
        assert relay.stop() == 0
        assert sweeper.stop() == 0
    report("SIGHUP ignored, SIGUSR1/SIGUSR2 toggled debug logging; relay and sweeper "
           "kept running and stopped with 0")


def test_second_sigterm_exits_at_once_and_counts_rows_left(db, own_kafka, tmp_path, report):
    kafka = own_kafka
    topic = "%s.Order" % db.schema
    kafka.create_topic(topic, 4)
    db.insert_events(make_events(aggregates=5, aggregate_type="Order", id_prefix="w"))
    # A long delivery timeout: after the first SIGTERM the relay waits for
    # its batch's reports while the broker is down.
    port = free_port()
    relay = Relay("outbox-relay", name="r-twice", log_dir=tmp_path,
                  env=relay_env(db, kafka, "r-twice", OUTBOX_KAFKA_DELIVERY_TIMEOUT_MS=60000,
                                OUTBOX_HTTP_ADDR="127.0.0.1:%d" % port))
    try:
        wait_until(lambda: db.status_counts()["PUBLISHED"] == 5, 30, what="warm-up")
        kafka.down()
        db.insert_events(make_events(aggregates=50, aggregate_type="Order", id_prefix="d"))
        held = 50
        wait_until(lambda: db.count("status = 'PUBLISHING' AND locked_by = 'r-twice'") == held,
                   30, interval=0.02, what="r-twice holding the 50 rows")
        # all of them with the producer (librdkafka's statistics, each second):
        # a stop gives back the rows it has not produced yet
        wait_with_producer(port, held, "the 50 rows in the producer's queue", timeout=20)
        relay.send_signal(signal.SIGTERM)
        # the first signal is taken (two sent at once would be one signal)
        relay.wait_log(r'msg="stop requested: finishing the work in hand" rows_publishing=%d'
                       % held, 5)
        assert relay.running()
        t0 = time.monotonic()
        relay.send_signal(signal.SIGTERM)
        rc = relay.wait(10)
        took = time.monotonic() - t0
    finally:
        kafka.up()
        relay.kill()
    assert rc == 1, relay.log_text()[-2000:]
    assert took < 2, took
    m = re.search(r'level=error .*msg="second stop signal: exiting at once" '
                  r'rows_publishing=(\d+)', relay.log_text())
    assert m, relay.log_text()[-2000:]
    left = db.count("status = 'PUBLISHING' AND locked_by = 'r-twice'")
    assert int(m.group(1)) == left == held, (m.group(1), left, held)
    report("second SIGTERM with %d rows held: exit %d after %.2fs, logged rows_publishing=%s",
           held, rc, took, m.group(1))
