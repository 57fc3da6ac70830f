"""The outbox table goes away under a running relay (dropped, or renamed by
an operator): the relay reports not-ready, backs off like a lost connection
(no error line every poll interval), and when the table is back (created
again, or renamed back) it publishes again. The relay works on whatever
OUTBOX_TABLE names: after a rename it waits for a table of that name."""
import re

import pytest

from conftest import relay_env
from harness import Relay, http_status, free_port, make_events, wait_until, _migrations


readyz = http_status  # the endpoint these tests watch is /readyz


def recreate(db):
    db.execute("SET search_path TO %s" % db.schema)
    for path in _migrations():
        with open(path, encoding="utf-8") as f:
            db.execute(f.read())


@pytest.mark.parametrize("how", ["drop", "rename"])
def test_table_gone_backs_off_not_ready_and_recovers(db, kafka, tmp_path, report, how):
    addr = "127.0.0.1:%d" % free_port()
    relay = Relay("outbox-relay", name="r-gone", log_dir=tmp_path,
                  env=relay_env(db, kafka, "r-gone", OUTBOX_HTTP_ADDR=addr))
    with relay:
        db.insert_events(make_events(aggregates=5, id_prefix="before"))
        wait_until(lambda: db.status_counts()["PUBLISHED"] == 5, 30, what="first rows")
        wait_until(lambda: readyz(addr) == 200, 20, what="ready")
        if how == "drop":
            db.execute("DROP TABLE %s CASCADE" % db.table)
        else:
            db.execute("ALTER TABLE %s RENAME TO outbox_event_old" % db.table)
        wait_until(lambda: readyz(addr) == 503, 20, what="/readyz 503 while the table is gone")
        # backing off: retries double up to 5 s, not an error every poll interval
        relay.wait_log(r"retry_ms=(1600|3200|5000) .*does not exist", 30)
        log = relay.log_text()
        retries = re.findall(r'msg="cannot connect, retrying" retry_ms=(\d+)', log)
        assert retries and len(retries) < 15, retries
        assert not re.search(r'lock batch failed.*\n.*lock batch failed.*\n.*lock batch failed',
                             log), log[-2000:]
        if how == "drop":
            recreate(db)
        else:  # the operator undoes the rename
            db.execute("ALTER TABLE %s.outbox_event_old RENAME TO outbox_event" % db.schema)
        db.insert_events(make_events(aggregates=5, id_prefix="after"))
        wait_until(lambda: db.count("status = 'PUBLISHED' AND aggregate_id LIKE 'after%%'") == 5,
                   30, what="rows of the new table published")
        wait_until(lambda: readyz(addr) == 200, 20, what="ready again")
        assert relay.stop() == 0
    report("table %s: /readyz 503, %d reconnect tries with backoff %s ms, then published "
           "again from the new table", how, len(retries), retries[:8])
