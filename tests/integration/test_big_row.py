"""A row far larger than Kafka takes (a 126 MB payload; the producer's
message.max.bytes is librdkafka's default 1000000) goes DEAD with
MSG_SIZE_TOO_LARGE without the relay ever holding it: a row's size is known
before it is fetched, so the relay's peak resident set (VmHWM) stays under
64 MiB (the chart's limit is 256Mi), and the 100 ordinary rows beside it go
out (read back from Apache Kafka).

Measured on the Release build when tests/run built one (<repo>/build): the
sanitized build's shadow memory and freed-memory quarantine would measure the
sanitizer, not the relay."""
import decimal
import json
import time

import pytest

from conftest import relay_env
from harness import Relay, free_port, header, make_events, read_topics, wait_until
from observe import NEW_CORE, release_binary, vm_hwm_kib

BIG_MB = 126
PEAK_LIMIT_KIB = 64 * 1024
# The ordinary rows go out while the big one is dealt with: nothing about one
# row may hold the others back for longer than this.
ORDINARY_WITHIN_S = 15
# How long the test waits at most (a relay that reads the whole row takes about
# a minute here, and is then measured rather than timed out).
WAIT_S = 150


@pytest.fixture
def big_row(db):
    """One row with a BIG_MB MB payload, built by the server."""
    db.execute("INSERT INTO %s (aggregate_type, aggregate_id, aggregate_version, event_type,"
               " payload_json) VALUES ('Order', 'huge', 1, 'E',"
               " jsonb_build_object('pad', repeat('x', %d * 1024 * 1024)))"
               % (db.table, BIG_MB))
    (r,) = db.execute("SELECT outbox_id::text AS id, octet_length(payload_json::text) AS n"
                      " FROM %s WHERE aggregate_id = 'huge'" % db.table)
    assert r["n"] > BIG_MB * 1024 * 1024
    return r["id"]


@NEW_CORE
def test_a_126_mb_row_goes_dead_and_the_relay_stays_small(db, kafka, tmp_path, big_row,
                                                          report):
    topic = "%s.Order" % db.schema
    kafka.create_topic(topic, 4)
    ordinary = db.insert_events(make_events(aggregates=100, id_prefix="ok"))
    binary, which = release_binary("outbox-relay")
    port = free_port()
    env = relay_env(db, kafka, OUTBOX_HTTP_ADDR="127.0.0.1:%d" % port)
    with Relay(binary, name="relay", env=env, log_dir=tmp_path) as relay:
        started = time.monotonic()
        wait_until(lambda: db.count("outbox_id = ANY(%s::uuid[]) AND status = 'PUBLISHED'",
                                    (ordinary,)) == len(ordinary), WAIT_S,
                   what="the 100 ordinary rows PUBLISHED")
        ordinary_s = time.monotonic() - started
        wait_until(lambda: db.count("outbox_id = %s AND status = 'DEAD'", (big_row,)), WAIT_S,
                   what="the big row DEAD")
        peak = vm_hwm_kib(relay.pid)
        (dead,) = db.execute("SELECT last_error_code, last_error_message FROM %s"
                             " WHERE outbox_id = %%s" % db.table, (big_row,))
        assert relay.stop() == 0
    assert dead["last_error_code"] == "MSG_SIZE_TOO_LARGE", dead
    msgs = read_topics(kafka.bootstrap, topics=[topic])
    ids = {header(m, "event-id") for m in msgs}
    assert ids == set(ordinary), (len(ids), big_row in ids)
    report("%d MB row DEAD (%s: %s); 100 others published in %.1f s; relay (%s) VmHWM "
           "%.1f MiB (limit %d MiB)", BIG_MB, dead["last_error_code"],
           dead["last_error_message"], ordinary_s, which, peak / 1024, PEAK_LIMIT_KIB // 1024)
    assert peak < PEAK_LIMIT_KIB, "relay peak RSS %.1f MiB" % (peak / 1024)
    assert ordinary_s < ORDINARY_WITHIN_S, "the ordinary rows took %.1f s" % ordinary_s


def test_rows_whose_text_outweighs_their_storage_come_whole(db, kafka, tmp_path, report):
    """The relay budgets a row by its stored size until its text is measured
    (DESIGN, "Memory"): a row whose JSON is small as stored but whose text is
    large (a number with 16000 decimal places stores in a few bytes and
    writes 16 kB), a compressed one and a small one all reach Kafka with
    their payload and headers as the table holds them, read back and
    compared."""
    topic = "%s.Mixed" % db.schema
    kafka.create_topic(topic, 2)
    tiny = "1e-16000"
    rows = {
        # stored in under 200 bytes (99 here), 80 kB as text
        "wide": "jsonb_build_object('n', jsonb_build_array(%s))" % ",".join(
            ["'%s'::numeric" % tiny] * 5),
        # 300 kB of one character: stored compressed
        "packed": "jsonb_build_object('pad', repeat('p', 300000))",
        "small": "jsonb_build_object('s', 'x')",
    }
    for agg, payload in rows.items():
        db.execute("INSERT INTO %s (aggregate_type, aggregate_id, aggregate_version, event_type,"
                   " payload_json, headers_json) VALUES ('Mixed', '%s', 1, 'E', %s,"
                   " jsonb_build_object('h-%s', 'v', 'n', 1))" % (db.table, agg, payload, agg))
    stored = {r["aggregate_id"]: r for r in db.execute(
        "SELECT aggregate_id, outbox_id::text AS id, payload_json::text AS payload,"
        " pg_column_size(payload_json) AS stored, pg_column_compression(payload_json) AS comp"
        " FROM %s" % db.table)}
    assert stored["wide"]["stored"] < 200 and len(stored["wide"]["payload"]) > 65536
    assert stored["packed"]["comp"] is not None
    env = relay_env(db, kafka)
    # the suite's build (sanitized in tests/run): this reads the fetch's memory
    with Relay("outbox-relay", name="relay", env=env, log_dir=tmp_path) as relay:
        wait_until(lambda: db.count("status = 'PUBLISHED'") == len(rows), 30,
                   what="the three rows PUBLISHED")
        assert relay.stop() == 0
    msgs = read_topics(kafka.bootstrap, topics=[topic])
    by_id = {header(m, "event-id"): m for m in msgs}
    assert set(by_id) == {r["id"] for r in stored.values()}
    for agg, r in stored.items():
        m = by_id[r["id"]]
        # numbers as written: 1e-16000 as a float is 0.0
        value = json.loads(m["value"], parse_float=decimal.Decimal)
        assert value["payload"] == json.loads(r["payload"], parse_float=decimal.Decimal), agg
        assert header(m, "h-" + agg) == "v" and header(m, "n") == "1", agg
    report("payload stored in %d bytes and %d as text, one compressed (%s), one small: all "
           "three on Kafka as stored", stored["wide"]["stored"], len(stored["wide"]["payload"]),
           stored["packed"]["comp"])
