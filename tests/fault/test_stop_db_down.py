"""A stop while the database is down: the relay keeps retrying to mark its
batch until the stop grace runs out, and says what it does. Each retry line
gives the pause it really takes (retry_ms=200 while stopping, not the
reconnect backoff, which a stop cuts short). When the database comes back
within the grace, the batch is marked and the relay exits 0."""
import re
import signal

import pytest

from conftest import reconnect, relay_env
from harness import Relay, make_events, wait_until


def test_stop_with_database_down_retries_truthfully(pg, db, own_kafka, tmp_path, report):
    if not pg.restartable:
        pytest.skip("needs OUTBOX_TEST_PG_DIR to stop PostgreSQL")
    kafka = own_kafka
    kafka.create_topic("%s.Order" % db.schema, 4)
    db.insert_events(make_events(aggregates=3, id_prefix="w"))
    relay = Relay("outbox-relay", name="r-stopdb", log_dir=tmp_path,
                  env=relay_env(db, kafka, "r-stopdb"))
    try:
        wait_until(lambda: db.status_counts()["PUBLISHED"] == 3, 30, what="warm-up")
        kafka.down()  # the next batch waits for its delivery reports (3 s)
        db.insert_events(make_events(aggregates=20, id_prefix="d"))
        wait_until(lambda: db.count("status = 'PUBLISHING'"), 30, interval=0.02,
                   what="a batch in flight")
        pg.stop_server()
        relay.send_signal(signal.SIGTERM)
        # the batch fails; marking it needs the database: retried every 200 ms
        wait_until(lambda: len(re.findall(r'msg="cannot connect, retrying" retry_ms=\d+',
                                          relay.log_text())) >= 3, 20,
                   what="stop-time retries")
        pg.start_server()
        reconnect(db)
        rc = relay.wait(40)
    finally:
        kafka.up()
        if not pg.ready():
            pg.start_server()
        relay.kill()
    assert rc == 0, relay.log_text()[-2000:]
    log = relay.log_text()
    stop_at = log.index('msg="stop requested')
    retries = [int(x) for x in
               re.findall(r'msg="cannot connect, retrying" retry_ms=(\d+)', log[stop_at:])]
    assert retries and set(retries) == {200}, retries
    assert db.count("status = 'PUBLISHING'") == 0
    report("stop with the database down: %d retries, each logged retry_ms=200; database "
           "back within the grace: batch marked, exit 0", len(retries))
