"""A long transaction that holds rows back is named (docs/DESIGN.md,
"Observability"). Under OUTBOX_ORDERING=increasing a row goes out only once
every transaction older than its own has ended, and that horizon is the whole
server's: a transaction with an xid left open in ANOTHER database holds back
every newer row of this one. The relay must say which: one warn line "a long
transaction holds rows back" with its pid, age_s, database (and
application_name, state), the gauge outbox_oldest_transaction_age_seconds
above 0, and once it ends "the long transaction ended", the gauge 0 and the
rows published.

Broker: Apache Kafka (tests/run's)."""
import time

from conftest import relay_env
from fixtures import own_pg  # noqa: F401  (`pg`: a server of its own; the horizon is server-wide)
from harness import Relay, free_port, make_events, read_topics, wait_until
from observe import NEW_CORE, OtherDatabase, log_records, scrape

# The relay names the transaction at the first table sample (1 s after it
# starts, then every 10 s) that finds it 10 s old: 10 to 20 s after it opened,
# depending on where the warm-up ended against the first sample.
SAMPLE_S = 10
REPORT_BY_S = 2 * SAMPLE_S + 2
HELD_S = REPORT_BY_S + SAMPLE_S  # one more sample after the report: "once" is checked


@NEW_CORE
def test_long_transaction_in_another_database_is_named(db, pg, kafka, tmp_path, report):
    topic = "%s.Order" % db.schema
    kafka.create_topic(topic, 4)
    port = free_port()
    env = relay_env(db, kafka, OUTBOX_ORDERING="increasing",
                    OUTBOX_HTTP_ADDR="127.0.0.1:%d" % port)
    with OtherDatabase(pg, "longtx") as other, \
            Relay("outbox-relay", env=env, log_dir=tmp_path) as relay:
        warm = db.insert_events(make_events(aggregates=5, id_prefix="warm"))
        wait_until(lambda: db.count("status = 'PUBLISHED'") == len(warm), 30, what="warm-up")

        conn = other.connect()
        conn.autocommit = False
        try:
            with conn.cursor() as cur:
                cur.execute("SET application_name = 'nightly-report'")
                cur.execute("SELECT pg_current_xact_id()")  # takes an xid: the horizon stops
                cur.execute("SELECT pg_backend_pid()")
                pid = cur.fetchone()[0]
            opened = time.monotonic()
            held = db.insert_events(make_events(aggregates=20, id_prefix="held"))

            def named():
                for r in log_records(relay.log_text()):
                    if r.get("msg") == "a long transaction holds rows back" and \
                            r.get("pid") == str(pid):
                        return r
                return None
            line = wait_until(named, REPORT_BY_S, interval=0.2,
                              what="the warn line naming the transaction (pid %d)" % pid)
            assert line["level"] == "warn", line
            assert line.get("database") == other.name, line
            assert line.get("application_name") == "nightly-report", line
            assert float(line.get("age_s", "-1")) >= 0, line
            assert "state" in line, line
            age = wait_until(
                lambda: (scrape(port).value("outbox_oldest_transaction_age_seconds") or 0) > 0
                and scrape(port).value("outbox_oldest_transaction_age_seconds"),
                10, what="outbox_oldest_transaction_age_seconds > 0")
            # the rows it holds are held: none of them went out meanwhile
            assert db.count("outbox_id = ANY(%s::uuid[]) AND status = 'PUBLISHED'",
                            (held,)) == 0
            # once per transaction, not once per sample
            time.sleep(max(0.0, HELD_S - (time.monotonic() - opened)))
            lines = [r for r in log_records(relay.log_text())
                     if r.get("msg") == "a long transaction holds rows back"]
            assert len(lines) == 1, [r["_line"] for r in lines]
        finally:
            conn.rollback()
            conn.close()
        ended = time.monotonic()
        wait_until(lambda: db.count("outbox_id = ANY(%s::uuid[]) AND status = 'PUBLISHED'",
                                    (held,)) == len(held), 20,
                   what="the held rows PUBLISHED once it ended")
        released_s = time.monotonic() - ended
        wait_until(lambda: any(r.get("msg") == "the long transaction ended"
                               for r in log_records(relay.log_text())), 20,
                   what='"the long transaction ended"')
        wait_until(lambda: scrape(port).value("outbox_oldest_transaction_age_seconds") == 0,
                   20, what="outbox_oldest_transaction_age_seconds back to 0")
        assert relay.stop() == 0
    msgs = read_topics(kafka.bootstrap, topics=[topic])
    assert len(msgs) == len(warm) + len(held)
    report("xid open %d s in database %s (pid %d): named in %s; gauge %.1f s; rows went %.2f s"
           " after it ended", HELD_S, other.name, pid, line["_line"][:200], age, released_s)
