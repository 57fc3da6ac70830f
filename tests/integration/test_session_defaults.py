"""The daemons' sessions set what they rely on, whatever the database's
defaults (docs/DESIGN.md, "Sessions"): a database whose defaults are
hostile (ALTER DATABASE ... SET: serializable isolation, a 1 ms statement
timeout, lock timeout and idle-in-transaction timeout, a +14:00 time zone,
another DateStyle, an empty search_path) is served like any other. The relay
publishes everything (read back from Apache Kafka, per-aggregate order, the
occurred-at headers the rows' own instants in UTC) with no serialization
failure, cancelled statement or dropped session in its log, and its
sessions name themselves (application_name outbox-relay:<connection>:<relay id>); the
sweeper completes its sweeps (retention deletes the published rows)."""
import datetime

import psycopg2.errors

from conftest import relay_env
from harness import (Postgres, Relay, TestSchema, check_order, free_port, header, make_events,
                     read_topics, wait_until)
from observe import NEW_CORE, OtherDatabase, log_records

HOSTILE = {
    "default_transaction_isolation": "serializable",
    "statement_timeout": "1ms",
    "lock_timeout": "1ms",
    "idle_in_transaction_session_timeout": "1ms",
    "timezone": "Pacific/Kiritimati",
    "datestyle": "SQL, DMY",
    "intervalstyle": "sql_standard",
    "search_path": "nowhere",
}
# What a session that relied on the database's defaults would log.
FAILURES = ("40001", "could not serialize", "57014", "canceling statement", "55P03",
            "lock timeout", "25P03", "idle-in-transaction", "terminating connection",
            "connection lost", "cannot connect")


def db_warnings(text):
    return [r["_line"] for r in log_records(text)
            if r.get("level") in ("warn", "error") and r.get("mod") != "kafka"]


@NEW_CORE
def test_hostile_database_defaults(pg, kafka, tmp_path, report):
    with OtherDatabase(pg, "hostile") as other, \
            TestSchema(Postgres(url=other.url), "defaults") as db:
        # The schema was set up before the defaults changed; this connection
        # keeps the server's own defaults, every new one gets the hostile ones.
        for k, v in HOSTILE.items():
            db.execute("ALTER DATABASE %s SET %s = %%s" % (other.name, k), (v,))
        def shown():
            # a new session's first statement may itself meet the 1 ms timeout
            try:
                probe = other.connect()
            except psycopg2.errors.QueryCanceled:
                return None
            try:
                with probe.cursor() as cur:
                    cur.execute("SHOW statement_timeout")
                    return cur.fetchone()[0]
            except psycopg2.errors.QueryCanceled:
                return None
            finally:
                probe.close()
        # the defaults are in force for new sessions
        assert wait_until(shown, 10, interval=0.05, what="a new session's SHOW") == "1ms"

        topic = "%s.Order" % db.schema
        kafka.create_topic(topic, 4)
        rows = make_events(aggregates=20, versions=10)
        for i, r in enumerate(rows[:5]):
            r["occurred_at"] = "2024-02-29 23:59:59.%06d+00" % (i * 123457)
        db.insert_events(rows)
        port = free_port()
        env = relay_env(db, kafka, OUTBOX_RELAY_ID="r-defaults",
                        OUTBOX_HTTP_ADDR="127.0.0.1:%d" % port)
        sweeper_env = {**db.env(), "OUTBOX_HTTP_ADDR": "off", "OUTBOX_LOG_FORMAT": "text",
                       "OUTBOX_RELAY_ID": "s-defaults", "OUTBOX_SWEEP_INTERVAL_S": 1,
                       "OUTBOX_RETENTION_S": 1}
        with Relay("outbox-relay", name="relay", env=env, log_dir=tmp_path) as relay:
            wait_until(lambda: db.count("status = 'PUBLISHED'") == len(rows), 30,
                       what="every row PUBLISHED despite the database's defaults")
            names = db.execute("SELECT DISTINCT application_name FROM pg_stat_activity"
                               " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                               " AND backend_type = 'client backend'")
            assert sorted(r["application_name"] for r in names) == [
                "outbox-relay:%s:r-defaults" % c for c in ("lock", "mark", "side")], names
            assert relay.stop() == 0
        relay_warnings = db_warnings(relay.log_text())
        published = db.rows()
        with Relay("outbox-sweeper", name="sweeper", env=sweeper_env,
                   log_dir=tmp_path) as sweeper:
            wait_until(lambda: db.count("TRUE") == 0, 30,
                       what="the sweeper's retention deleting the published rows")
            assert sweeper.stop() == 0
        sweeper_warnings = db_warnings(sweeper.log_text())

    assert not relay_warnings, "\n".join(relay_warnings[:10])
    assert not sweeper_warnings, "\n".join(sweeper_warnings[:10])
    for text in (relay.log_text(), sweeper.log_text()):
        assert not [f for f in FAILURES if f in text], [f for f in FAILURES if f in text]
    msgs = read_topics(kafka.bootstrap, topics=[topic])
    ok, details = check_order(msgs)
    assert ok, details[:10]
    sent = {header(m, "event-id"): header(m, "occurred-at") for m in msgs}
    assert set(sent) == {r["outbox_id"] for r in published}
    for r in published:
        at = datetime.datetime.strptime(sent[r["outbox_id"]], "%Y-%m-%dT%H:%M:%S.%fZ").replace(
            tzinfo=datetime.timezone.utc)
        assert at == r["occurred_at"], (sent[r["outbox_id"]], r["occurred_at"])
    report("database defaults %s: %d rows published in order, occurred-at in UTC, no "
           "serialization failure or timeout; the sweeper's retention emptied the table",
           ", ".join("%s=%s" % kv for kv in HOSTILE.items()), len(rows))
