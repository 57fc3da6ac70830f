"""The NOTIFY channel '<schema>.<table>' is cut to at most 63 bytes on a
character boundary, by the trigger (schemas/postgres/001, 005) and by the
relay that LISTENs on it (docs/DESIGN.md, "The outbox table"):

  - a valid 52-byte non-ASCII schema name ("é" x 26; the channel is 65 bytes
    in 40 characters): the application's INSERT succeeds (a trigger cutting
    63 characters sends a 65-byte name, which PostgreSQL refuses: "channel
    name too long"), and an idle relay wakes at once;
  - a 63-byte non-ASCII table name, whose 63rd channel byte falls inside a
    character: trigger and relay both cut before that character, and the
    relay wakes;
  - 005 upgrades a table whose trigger still cuts characters, and applying
    it twice changes nothing more.
The relay's poll interval is 30 s: a row published within WAKE_S was found
through NOTIFY, not by polling. Broker: Apache Kafka (tests/run's)."""
import secrets
import time

import psycopg2
import pytest

from harness import Relay, header, read_topics, wait_until
from observe import migrations_sql

POLL_MS = 30000
WAKE_S = 2.0  # NOTIFY -> lock -> publish -> mark, with room for a loaded machine
E_ACUTE = "\u00e9"  # 2 bytes in UTF-8

# The trigger function as 001 made it before 005: cut to 63 characters.
OLD_TRIGGER = """
CREATE OR REPLACE FUNCTION outbox_event_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(left(TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME, 63), '');
    RETURN NULL;
END;
$$;
"""


def quote(name):
    return '"%s"' % name.replace('"', '""')


class Schema:
    """A schema of a given (non-ASCII) name with the migrations applied; the
    table optionally renamed."""

    def __init__(self, pg, name, table="outbox_event"):
        self.pg, self.name, self.tname = pg, name, table
        self.conn = pg.connect()
        with self.conn.cursor() as cur:
            cur.execute("CREATE SCHEMA %s" % quote(name))
            cur.execute("SET search_path TO %s" % quote(name))
            for _, sql in migrations_sql():
                cur.execute(sql)
            if table != "outbox_event":
                cur.execute("ALTER TABLE outbox_event RENAME TO %s" % quote(table))
        self.table = "%s.%s" % (quote(name), quote(table))
        # OUTBOX_TABLE, unquoted: non-ASCII letters are identifier letters
        self.setting = "%s.%s" % (name, table)

    def insert(self, agg, version=1):
        with self.conn.cursor() as cur:
            cur.execute("INSERT INTO %s (aggregate_type, aggregate_id, aggregate_version,"
                        " event_type, payload_json) VALUES ('Order', %%s, %%s, 'E', '{}')"
                        " RETURNING outbox_id::text" % self.table, (agg, version))
            return cur.fetchone()[0]

    def status(self, oid):
        with self.conn.cursor() as cur:
            cur.execute("SELECT status FROM %s WHERE outbox_id = %%s" % self.table, (oid,))
            return cur.fetchone()[0]

    def drop(self):
        with self.conn.cursor() as cur:
            cur.execute("DROP SCHEMA %s CASCADE" % quote(self.name))
        self.conn.close()


def channel_bytes(schema):
    return len(("%s.%s" % (schema.name, schema.tname)).encode())


def relay_wakes(s, kafka, tmp_path, name):
    """Starts an idle relay (poll 30 s) on s; returns seconds from an INSERT
    to its row PUBLISHED, and the message read back."""
    topic = "notify_%s.Order" % secrets.token_hex(4)
    kafka.create_topic(topic, 1)
    env = {"OUTBOX_DATABASE_URL": s.pg.url, "OUTBOX_TABLE": s.setting,
           "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": kafka.bootstrap, "OUTBOX_HTTP_ADDR": "off",
           "OUTBOX_LOG_FORMAT": "text", "OUTBOX_POLL_INTERVAL_MS": POLL_MS,
           "OUTBOX_TOPIC_TEMPLATE": topic}
    with Relay("outbox-relay", name=name, env=env, log_dir=tmp_path) as relay:
        warm = s.insert("warm")  # the relay's first lock statement takes it
        wait_until(lambda: s.status(warm) == "PUBLISHED" or not relay.running(), 20,
                   what="warm-up row PUBLISHED")
        assert relay.running(), (relay.returncode, relay.log_text()[-1000:])
        time.sleep(1.0)  # the relay is now idle, waiting up to its poll interval
        t0 = time.monotonic()
        oid = s.insert("woken")
        wait_until(lambda: s.status(oid) == "PUBLISHED", POLL_MS / 1000 + 5, interval=0.02,
                   what="the row PUBLISHED")
        took = time.monotonic() - t0
        assert relay.stop() == 0
    msgs = [m for m in read_topics(kafka.bootstrap, topics=[topic])
            if header(m, "event-id") == oid]
    assert len(msgs) == 1
    return took


@pytest.fixture
def wide_schema(pg):
    s = Schema(pg, E_ACUTE * 26)
    yield s
    s.drop()


def test_52_byte_non_ascii_schema_inserts_and_wakes_the_relay(wide_schema, kafka, tmp_path,
                                                               report):
    s = wide_schema
    assert len(s.name.encode()) == 52 and channel_bytes(s) == 65
    took = relay_wakes(s, kafka, tmp_path, "wide")
    report("schema of 52 bytes (26 x U+00E9): INSERT ok, idle relay published %.3f s after"
           " the INSERT (poll interval %d s)", took, POLL_MS // 1000)
    assert took < WAKE_S, "not woken by NOTIFY: %.2f s" % took


def test_channel_cut_inside_a_character_wakes_the_relay(pg, kafka, tmp_path, report):
    name = "t_%s" % secrets.token_hex(4)          # 10 bytes, then '.'
    s = Schema(pg, name, "x" + E_ACUTE * 31)      # 63 bytes: é starts at even offsets
    try:
        assert channel_bytes(s) == 74
        with s.conn.cursor() as cur:
            cur.execute("LISTEN %s" % quote(("%s.%s" % (name, s.tname)).encode()[:62].decode()))
        s.insert("probe")
        s.conn.poll()
        got = [n.channel for n in s.conn.notifies]
        assert got and len(got[0].encode()) == 62, got  # 63 would split an é
        took = relay_wakes(s, kafka, tmp_path, "cut")
    finally:
        s.drop()
    report("channel of 74 bytes cut to 62 (the 63rd byte inside U+00E9): relay published %.3f s"
           " after the INSERT", took)
    assert took < WAKE_S, "not woken by NOTIFY: %.2f s" % took


def test_005_upgrades_the_trigger_of_an_earlier_001(wide_schema):
    s = wide_schema
    with s.conn.cursor() as cur:
        cur.execute(OLD_TRIGGER)
        with pytest.raises(psycopg2.Error) as e:
            s.insert("old")
        assert "channel name too long" in str(e.value)
        upgrade = [sql for name, sql in migrations_sql() if name.startswith("005_")]
        assert len(upgrade) == 1
        for _ in range(2):
            cur.execute(upgrade[0])
        s.insert("new")
        cur.execute("SELECT count(*) FROM pg_proc WHERE proname = 'outbox_event_notify'"
                    " AND pronamespace = %s::regnamespace", (quote(s.name),))
        assert cur.fetchone()[0] == 1
