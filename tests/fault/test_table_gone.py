"""The outbox table goes away under a running relay (dropped, or renamed by
an operator): the relay reports not-ready (the `table` condition of /readyz
says it is missing), backs off like a lost connection (each connection
reconnects and resolves OUTBOX_TABLE again after 100 ms doubling to 5 s),
logs once per state change (`statement failing` with the statement and its
SQLSTATE, `table missing, retrying` per connection), not once per attempt,
and when the table is back (created again, or renamed back) it publishes
again within the capped backoff (docs/DESIGN.md, "Exit codes and signals",
"Statements"). The relay works on whatever OUTBOX_TABLE names: after a
rename it waits for a table of that name.

The reconnect attempts are counted on the server: every attempt is a session
of the database (pg_stat_database.sessions). The test has a database of its
own, so nothing else opens one there while the table is gone, whatever runs
beside it on the server."""
import collections
import re
import time

import pytest

from conftest import relay_env
from harness import (Postgres, Relay, TestSchema, free_port, make_events, wait_until,
                     _migrations)
from observe import OtherDatabase, readyz

MISSING_LINE = r'msg="table missing, retrying" connection=(\w+) retry_ms=(\d+)'
FAILING_LINE = r'msg="statement failing" statement=(\w+) sqlstate=(\w+)'
# A window that starts once the first connection's backoff has grown past
# 3.2 s: a connection whose pauses reached the 5 s cap tries about twice in
# it, one still growing its backoff (the side connection notices at its next
# table sample) at most 6 times; a relay trying every poll interval (200 ms)
# would open 50 sessions per connection.
WINDOW_FROM_S, WINDOW_S = 6.5, 10.0
MAX_WINDOW_SESSIONS = 12
# The table is back: the longest pause (5 s), then a connect and a lock.
MAX_RECOVERY_S = 5.0 + 2.0


def recreate(db):
    db.execute("SET search_path TO %s" % db.schema)
    for path in _migrations():
        with open(path, encoding="utf-8") as f:
            db.execute(f.read())


def sessions(db):
    return db.execute("SELECT sessions FROM pg_stat_database"
                      " WHERE datname = current_database()")[0]["sessions"]


@pytest.fixture
def own_db(pg):
    """A schema in a database of the test's own (see the module's text)."""
    with OtherDatabase(pg, "gone") as other, TestSchema(Postgres(url=other.url), "gone") as db:
        yield db


@pytest.mark.parametrize("how", ["drop", "rename"])
def test_table_gone_backs_off_not_ready_and_recovers(own_db, kafka, tmp_path, report, how):
    db = own_db
    port = free_port()
    relay = Relay("outbox-relay", name="r-gone", log_dir=tmp_path,
                  env=relay_env(db, kafka, "r-gone", OUTBOX_HTTP_ADDR="127.0.0.1:%d" % port))
    with relay:
        db.insert_events(make_events(aggregates=5, id_prefix="before"))
        wait_until(lambda: db.status_counts()["PUBLISHED"] == 5, 30, what="first rows")
        wait_until(lambda: readyz(port).status == 200, 20, what="ready")
        at_drop = sessions(db)
        if how == "drop":
            db.execute("DROP TABLE %s CASCADE" % db.table)
        else:
            db.execute("ALTER TABLE %s RENAME TO outbox_event_old" % db.table)
        def table_missing():
            r = readyz(port)
            c = r.condition("table")
            return r.status == 503 and c and not c["ok"] and r
        gone = wait_until(table_missing, 20, what="/readyz 503, the table condition failing")
        table = gone.condition("table")
        assert "does not exist" in table["reason"], gone
        relay.wait_log(MISSING_LINE.replace(r"(\w+)", "lock", 1), 20)
        first_missing = time.monotonic()
        # the window's ends are moments of a measurement, not synchronisation
        time.sleep(WINDOW_FROM_S)
        s0 = sessions(db)
        time.sleep(WINDOW_S)
        in_window = sessions(db) - s0
        during = sessions(db) - at_drop
        during_s = time.monotonic() - first_missing
        log = relay.log_text()
        missing = collections.Counter(c for c, _ in re.findall(MISSING_LINE, log))
        failing = collections.Counter(re.findall(FAILING_LINE, log))
        assert readyz(port).status == 503
        if how == "drop":
            recreate(db)
        else:  # the operator undoes the rename
            db.execute("ALTER TABLE %s.outbox_event_old RENAME TO outbox_event" % db.schema)
        back = time.monotonic()
        db.insert_events(make_events(aggregates=5, id_prefix="after"))
        wait_until(lambda: db.count("status = 'PUBLISHED' AND aggregate_id LIKE 'after%%'") == 5,
                   30, what="rows of the new table published")
        published_s = time.monotonic() - back
        wait_until(lambda: readyz(port).status == 200, 20, what="ready again")
        assert relay.stop() == 0
    # backing off: a few sessions in the window, not one every poll interval
    assert 1 <= in_window <= MAX_WINDOW_SESSIONS, (in_window, log[-2000:])
    # one line per state change: the same failure again is not logged again
    assert missing["lock"] == 1 and max(missing.values()) == 1, missing
    assert failing and max(failing.values()) == 1, failing
    assert all(state == "42P01" for _, state in failing), failing
    lines = sum(missing.values()) + sum(failing.values())
    assert during >= lines + 3, "%d reconnect sessions for %d log lines" % (during, lines)
    assert published_s <= MAX_RECOVERY_S, published_s
    report("table %s: /readyz 503 (%s); %d reconnect sessions in %.0f s, %d in %.0f s from"
           " %.1f s after the first failure; log lines: missing %s, failing %s; published"
           " again %.1f s after the table was back", how, table["reason"][:80], during,
           during_s, in_window, WINDOW_S, WINDOW_FROM_S,
           dict(missing), dict(failing), published_s)
