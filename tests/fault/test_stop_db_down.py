"""A stop while the database is down: the relay keeps retrying to mark its
batch until the stop grace runs out, and says what it does. A stop request
cuts the reconnect backoff short (the database has been down for seconds, so
its pauses have grown past a second): every retry after it pauses 200 ms,
and the first failure of each connection after it is logged with
retry_ms=200 (the pause really taken), even when it fails as before; further
attempts that fail the same way are not logged again (one line per state
change, docs/DESIGN.md "Exit codes and signals"). When the database comes
back within the grace, the batch is marked at the next 200 ms retry and the
relay exits 0."""
import re
import signal
import time

import pytest

from conftest import parse_ts, reconnect, relay_env
from fixtures import own_pg  # noqa: F401  (the module's own server, as `pg`)
from harness import Relay, make_events, wait_until

RETRY_LINE = r'msg="database connection down, retrying" connection=(\w+) retry_ms=(\d+)'
REFUSED_LINE = (r'msg="database connection down, retrying" connection=(\w+) retry_ms=\d+'
                r' err="connect: [^\n]*Connection refused')
# How long the database is down before the stop request: the reconnect
# pauses (100 ms doubling) have grown to 1.6 s or more by then.
DOWN_BEFORE_S = 3.5
# How long the database stays down after the stop request: about 30 retries.
DOWN_S = 6.0
# Attempts that fail the same way are not logged: over DOWN_S at 200 ms a
# connection tries about 30 times, and the ways it fails while the server
# stops, is down and starts are few.
MAX_LINES_PER_CONNECTION = 6


def lines_after_stop(log):
    at = log.find('msg="stop requested')
    return [] if at < 0 else re.findall(RETRY_LINE, log[at:])


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
        down_at = time.monotonic()
        # every connection fails the same way now, and stays failing
        wait_until(lambda: len(set(re.findall(REFUSED_LINE, relay.log_text()))) == 3, 20,
                   what="every connection refused")
        # the fault's length, not a synchronisation: the backoff grows meanwhile
        time.sleep(max(0.0, DOWN_BEFORE_S - (time.monotonic() - down_at)))
        relay.send_signal(signal.SIGTERM)
        stop_sent = time.monotonic()
        # the batch fails; marking it needs the database: the mark connection
        # retries every 200 ms and says so
        wait_until(lambda: [c for c, _ in lines_after_stop(relay.log_text()) if c == "mark"],
                   20, what="the mark connection's retry line after the stop request")
        # the fault's length, not a synchronisation: the database stays down
        time.sleep(max(0.0, DOWN_S - (time.monotonic() - stop_sent)))
        pg.start_server()
        up_at = time.time()
        reconnect(db)
        rc = relay.wait(40)
    finally:
        kafka.up()
        if not pg.ready():
            pg.start_server()
        relay.kill()
    log = relay.log_text()
    assert rc == 0, log[-2000:]
    retries = lines_after_stop(log)
    assert retries and {ms for _, ms in retries} == {"200"}, retries
    per_conn = {c: sum(1 for x, _ in retries if x == c) for c, _ in retries}
    assert max(per_conn.values()) <= MAX_LINES_PER_CONNECTION, (per_conn, retries)
    # the pause running at the stop request was cut to 200 ms
    stop_at = log.index('msg="stop requested')
    stop_ts = parse_ts(re.search(r'ts=(\S+) level=info mod=relay msg="stop requested',
                                 log).group(1)).timestamp()
    first = {}
    for m in re.finditer(r'ts=(\S+) level=warn mod=db ' + RETRY_LINE, log[stop_at:]):
        first.setdefault(m.group(2), parse_ts(m.group(1)).timestamp() - stop_ts)
    assert set(first) == {"lock", "mark", "side"} and max(first.values()) < 0.5, first
    # the next 200 ms retry found the server: no backoff of seconds was waited
    m = re.search(r'ts=(\S+) level=info mod=db msg="connected" connection=mark', log[stop_at:])
    assert m, log[stop_at:][-2000:]
    late_s = parse_ts(m.group(1)).timestamp() - up_at
    assert late_s < 1.0, "the mark connection came back %.2f s after the server" % late_s
    assert db.count("status = 'PUBLISHING'") == 0
    report("stop with the database down %.1f s before and %.0f s after: each connection's"
           " first retry %.2f s after the stop at most; retry lines after the stop %s, each"
           " retry_ms=200; mark connection up %+.2f s from the server's start returning;"
           " batch marked, exit 0", DOWN_BEFORE_S, DOWN_S, max(first.values()), per_conn,
           late_s)
