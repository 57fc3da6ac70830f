"""Scenario 5 (G4): poison rows go DEAD with the right code and stop their
own aggregate only: a payload over message.max.bytes (MSG_SIZE_TOO_LARGE),
headers_json that is not an object (INVALID_HEADERS), and a row whose
retriable failures exhaust OUTBOX_MAX_ATTEMPTS (its last Kafka error).

Broker: Apache Kafka (tests/run's), stopped (SIGSTOP) while the tired row
uses up its attempts. Rejections only the broker makes (a topic's
max.message.bytes, a missing topic) are in test_broker_rejects.py."""
import re

from conftest import check_audit, check_kafka, relay_env
from harness import Relay, header, make_events, wait_until

MAX_ATTEMPTS = 2


def row(agg, v, **kw):
    r = {"aggregate_type": "Order", "aggregate_id": agg, "aggregate_version": v,
         "event_type": "E", "payload_json": {"agg": agg, "v": v}}
    r.update(kw)
    return r


def test_poison_rows_dead_and_isolated(db, kafka, tmp_path, report):
    topic = "%s.Order" % db.schema
    kafka.create_topic(topic, 4)
    poison = [row("big", 1, payload_json={"pad": "x" * 1_100_000}), row("big", 2), row("big", 3),
              row("hdr", 1, headers_json="[1, 2]"), row("hdr", 2),
              row("hdr2", 1, headers_json='"just text"'), row("hdr2", 2)]
    healthy = make_events(aggregates=30, versions=3, id_prefix="ok")
    db.insert_events(poison + healthy)
    env = relay_env(db, kafka, "r-poison", OUTBOX_MAX_ATTEMPTS=MAX_ATTEMPTS,
                    OUTBOX_BATCH_SIZE=50)
    with Relay("outbox-relay", name="r-poison", log_dir=tmp_path, env=env) as relay:
        wait_until(lambda: db.status_counts()["DEAD"] == 3 and
                   db.status_counts()["PUBLISHED"] == len(healthy), 60,
                   what="3 poison rows DEAD, healthy rows PUBLISHED")
        # A retriable failure on every attempt: the broker hangs while the
        # row is tried MAX_ATTEMPTS times.
        with kafka.paused():
            db.insert_events([row("tired", 1), row("tired", 2)])
            wait_until(lambda: db.count("aggregate_id = 'tired' AND status = 'DEAD'") == 1, 60,
                       what="the row out of attempts DEAD")
        # Everything else keeps flowing: later versions of healthy aggregates and
        # new aggregates, inserted after the deaths.
        more = make_events(aggregates=30, versions=5, id_prefix="ok")[len(healthy):]
        more += make_events(aggregates=10, versions=2, id_prefix="new")
        db.insert_events(more)
        wait_until(lambda: db.status_counts()["PUBLISHED"] == len(healthy) + len(more), 60,
                   what="healthy aggregates PUBLISHED after the poison")
        assert relay.stop() == 0

    dead = {(r["aggregate_id"], r["aggregate_version"]): r
            for r in db.rows(where="status = 'DEAD'")}
    expected = {("big", 1), ("hdr", 1), ("hdr2", 1), ("tired", 1)}
    if set(dead) != expected:  # shown with the failure: what happened to the tired rows
        tired_rows = db.rows(where="aggregate_id = 'tired'")
        for r in tired_rows:
            print({k: r[k] for k in ("aggregate_version", "outbox_id", "status", "attempt_count",
                                     "last_error_code", "last_error_message")})
        for ln in relay.log_text().splitlines():
            if (any(r["outbox_id"] in ln for r in tired_rows)
                    or re.search(r" (level=(warn|error)|mod=db) ", ln)):
                print(ln)
    assert set(dead) == expected, set(dead)
    assert dead[("big", 1)]["last_error_code"] == "MSG_SIZE_TOO_LARGE"
    assert dead[("hdr", 1)]["last_error_code"] == "INVALID_HEADERS"
    assert dead[("hdr2", 1)]["last_error_code"] == "INVALID_HEADERS"
    for k in (("big", 1), ("hdr", 1), ("hdr2", 1)):
        assert dead[k]["attempt_count"] == 1, ("permanent errors are not retried", dead[k])
    tired = dead[("tired", 1)]
    assert tired["attempt_count"] == MAX_ATTEMPTS
    assert tired["last_error_code"] in ("_MSG_TIMED_OUT", "_PURGE_QUEUE", "_TRANSPORT"), tired
    assert "attempt %d of %d" % (MAX_ATTEMPTS, MAX_ATTEMPTS) in tired["last_error_message"]
    for r in dead.values():
        assert r["last_error_message"] and "xxxxxxxx" not in r["last_error_message"]
        assert r["locked_by"] is None

    blocked = db.rows(where="aggregate_id IN ('big', 'hdr', 'hdr2', 'tired') "
                            "AND aggregate_version > 1")
    assert [r["status"] for r in blocked] == ["PENDING"] * 5, blocked
    assert all(r["attempt_count"] == 0 for r in blocked), "blocked rows were never locked"
    others = db.rows(where="aggregate_id NOT IN ('big', 'hdr', 'hdr2', 'tired')")
    assert all(r["status"] == "PUBLISHED" for r in others)

    table = db.rows()
    audit = check_audit(db)
    assert not audit.violations, audit.violations[:10]
    kc, problems = check_kafka(kafka, [topic], table,
                               dup_allowed={o for o, n in audit.locks.items() if n > 1})
    assert not problems, problems
    on_kafka = {(m["key"], header(m, "aggregate-version")) for m in kc.msgs
                if m["key"] in ("big", "hdr", "hdr2", "tired")}
    # A request that timed out may still have been written: the hung broker
    # reads it once it resumes. So tired/1, DEAD after timeouts, may be on
    # Kafka (at least once); the permanent rejections and every version
    # behind a DEAD one may not.
    assert on_kafka <= {("tired", "1")}, on_kafka
    assert len(kc.ids) == len(others) + len(on_kafka)
    assert "x" * 1000 not in relay.log_text(), "payload in the log"
    report("DEAD: big/1 %s, hdr/1 %s, hdr2/1 %s (1 attempt each), tired/1 %s after %d "
           "attempts; 5 later versions of those aggregates PENDING, never locked; %d rows of "
           "%d other aggregates PUBLISHED (incl. %d inserted after the deaths); tired/1 "
           "written by the broker after its timeouts: %s; kafka: %d "
           "messages, no version behind a DEAD one, order ok",
           dead[("big", 1)]["last_error_code"], dead[("hdr", 1)]["last_error_code"],
           dead[("hdr2", 1)]["last_error_code"], tired["last_error_code"],
           tired["attempt_count"], len(others), len({r["aggregate_id"] for r in others}),
           len(more), bool(on_kafka), len(kc.msgs))


FAULT_VERSION = 7
# after every healthy aggregate in a batch's order (by aggregate), so that a
# relay blaming the first row it asked for would blame a healthy one
BAD = "zz-bad"


def insert_faulty_aggregate(db, kafka):
    """The topic (4 partitions); 40 healthy aggregates with the versions below
    FAULT_VERSION, and BAD with versions 1 to FAULT_VERSION + 2, inserted.
    Returns (topic, healthy rows, BAD's rows, BAD's outbox_ids by version)."""
    topic = "%s.Order" % db.schema
    kafka.create_topic(topic, 4)
    healthy = make_events(aggregates=40, versions=FAULT_VERSION - 1, id_prefix="ok")
    bad = [row(BAD, v) for v in range(1, FAULT_VERSION + 3)]
    ids = db.insert_events(healthy + bad)
    return topic, healthy, bad, dict(zip(range(1, FAULT_VERSION + 3), ids[len(healthy):]))


def wait_faulty_row_dead(db, healthy, what):
    """Until BAD's FAULT_VERSION is DEAD and every row before it PUBLISHED."""
    wait_until(lambda: db.status_counts()["DEAD"] == 1 and
               db.status_counts()["PUBLISHED"] == len(healthy) + FAULT_VERSION - 1, 60,
               what="%s DEAD, every row before it PUBLISHED" % what)


def run_until_faulty_row_dead(db, kafka, tmp_path, name, healthy, what, **env):
    """Runs relay `name` with env until BAD's FAULT_VERSION is DEAD and every
    row before it PUBLISHED, then stops it. Returns (the relay, the DEAD rows:
    that one only)."""
    with Relay("outbox-relay", name=name, log_dir=tmp_path,
               env=relay_env(db, kafka, name, **env)) as relay:
        wait_faulty_row_dead(db, healthy, what)
        assert relay.stop() == 0
    dead = db.rows(where="status = 'DEAD'")
    assert [(r["aggregate_id"], r["aggregate_version"]) for r in dead] == \
        [(BAD, FAULT_VERSION)], dead
    return relay, dead


def test_row_postgresql_cannot_read_goes_dead_alone(db, kafka, tmp_path, report):
    """A row whose fetch fails with a data exception (the test hook makes
    every fetch that reads a row of version FAULT_VERSION fail, as damaged
    storage would): the relay reads the batch's rows one at a time until
    the row fails alone, and only that row goes DEAD."""
    topic, healthy, bad, _ = insert_faulty_aggregate(db, kafka)
    env = relay_env(db, kafka, "r-unreadable", OUTBOX_TEST_FETCH_FAULT_VERSION=FAULT_VERSION)
    with Relay("outbox-relay", name="r-unreadable", log_dir=tmp_path, env=env) as relay:
        wait_faulty_row_dead(db, healthy, "the unreadable row")
        more = make_events(aggregates=10, versions=2, id_prefix="new")
        db.insert_events(more)
        wait_until(lambda: db.count("aggregate_id LIKE 'new%%' AND status = 'PUBLISHED'")
                   == len(more), 60, what="rows written after it PUBLISHED")
        assert relay.stop() == 0
    dead = db.rows(where="status = 'DEAD'")
    assert [(r["aggregate_id"], r["aggregate_version"]) for r in dead] == \
        [(BAD, FAULT_VERSION)], dead
    assert dead[0]["last_error_code"] == "INVALID_VALUE", dead[0]
    assert "division by zero" in dead[0]["last_error_message"], dead[0]
    assert dead[0]["attempt_count"] == 1 and "attempt" not in dead[0]["last_error_message"], \
        ("a row PostgreSQL cannot read is DEAD at its first attempt", dead[0])
    held = db.rows(where="aggregate_id = %s AND aggregate_version > %s",
                   params=(BAD, FAULT_VERSION))
    assert all(r["status"] in ("PENDING", "FAILED") for r in held), held
    table = db.rows()
    audit = check_audit(db)
    assert not audit.violations, audit.violations[:10]
    kc, problems = check_kafka(kafka, [topic], table, dup_allowed=audit.relocked_after_stale)
    assert not problems, problems
    on_kafka = {(header(m, "aggregate-id"), int(header(m, "aggregate-version"))) for m in kc.msgs}
    assert not {(BAD, v) for v in range(FAULT_VERSION, FAULT_VERSION + 3)} & on_kafka
    report("%s/%d DEAD INVALID_VALUE (%s); %d-%d held; %d other rows PUBLISHED, none DEAD;"
           " %d messages, order ok", BAD, FAULT_VERSION, dead[0]["last_error_message"][:60],
           FAULT_VERSION + 1, FAULT_VERSION + 2, len(table) - len(bad), len(kc.msgs))


def test_row_whose_read_fails_otherwise_is_retried_then_dead(db, kafka, tmp_path, report):
    """A row whose lone read keeps failing with an error that is not a data
    exception (the test hook makes every fetch that reads a row of version
    FAULT_VERSION fail with 42704, an unknown setting): READ_FAILED, retried
    with backoff, DEAD once its attempts are used up; the version after it
    spends none, nor does the row itself while the version before it was
    still with Kafka, and nothing else is blamed."""
    attempts = 3
    topic, healthy, bad, bad_ids = insert_faulty_aggregate(db, kafka)
    relay, dead = run_until_faulty_row_dead(
        db, kafka, tmp_path, "r-readfail", healthy, "the row whose read fails",
        OUTBOX_TEST_FETCH_FAULT_VERSION=-FAULT_VERSION, OUTBOX_MAX_ATTEMPTS=attempts)
    assert dead[0]["last_error_code"] == "READ_FAILED", dead[0]
    assert "outbox.test_fetch_fault" in dead[0]["last_error_message"], dead[0]
    assert dead[0]["attempt_count"] == attempts, dead[0]
    assert "attempt %d of %d" % (attempts, attempts) in dead[0]["last_error_message"], dead[0]
    held = db.rows(where="aggregate_id = %s AND aggregate_version > %s",
                   params=(BAD, FAULT_VERSION))
    assert all(r["attempt_count"] == 0 for r in held), held
    audit = check_audit(db)
    assert not audit.violations, audit.violations[:10]
    # every FAILED or DEAD mark of the faulty version committed after the
    # version before it was PUBLISHED
    trail = db.execute("SELECT outbox_id::text AS id, new_status, xact_ts FROM %s.lock_audit"
                       " WHERE outbox_id = ANY(%%s::uuid[]) ORDER BY seq" % db.schema,
                       ([bad_ids[FAULT_VERSION - 1], bad_ids[FAULT_VERSION]],))
    before = [t["xact_ts"] for t in trail
              if t["id"] == bad_ids[FAULT_VERSION - 1] and t["new_status"] == "PUBLISHED"]
    failed = [t["xact_ts"] for t in trail
              if t["id"] == bad_ids[FAULT_VERSION] and t["new_status"] in ("FAILED", "DEAD")]
    assert len(before) == 1 and len(failed) == attempts, trail
    assert all(f > before[0] for f in failed), trail
    table = db.rows()
    kc, problems = check_kafka(kafka, [topic], table, dup_allowed=audit.relocked_after_stale)
    assert not problems, problems
    on_kafka = {(header(m, "aggregate-id"), int(header(m, "aggregate-version"))) for m in kc.msgs}
    assert not {(BAD, v) for v in range(FAULT_VERSION, FAULT_VERSION + 3)} & on_kafka
    assert "a fetch failed: reading its rows one at a time" in relay.log_text()
    report("%s/%d DEAD READ_FAILED after %d attempts (%s), each after %s/%d was PUBLISHED; "
           "%d-%d held with 0 attempts; %d other rows PUBLISHED, none DEAD; %d messages, "
           "order ok", BAD, FAULT_VERSION, attempts, dead[0]["last_error_message"][:60], BAD,
           FAULT_VERSION - 1, FAULT_VERSION + 1, FAULT_VERSION + 2, len(table) - len(bad),
           len(kc.msgs))


def test_row_whose_read_ends_the_session_is_retried_then_dead(db, kafka, tmp_path, report):
    """A row whose read ends the server process computing it (a crash, or the
    test hook: every fetch that reads a row of version FAULT_VERSION has its
    backend terminate itself): the relay must not fetch it again for ever,
    the server restarting each time. A loss during a batch's fetch has its
    rows read one at a time; a loss while the row is read alone counts as a
    failed read (READ_FAILED, an attempt spent, a backoff), and the row goes
    DEAD once its attempts are used up; its aggregate's later versions wait
    behind it, and every other row goes."""
    attempts = 2
    topic, healthy, bad, _ = insert_faulty_aggregate(db, kafka)
    relay, dead = run_until_faulty_row_dead(
        db, kafka, tmp_path, "r-kill", healthy, "the row whose read ends the session",
        OUTBOX_TEST_FETCH_KILL_VERSION=FAULT_VERSION, OUTBOX_MAX_ATTEMPTS=attempts)
    assert dead[0]["last_error_code"] == "READ_FAILED", dead[0]
    assert "connection was lost while this row alone was read" in \
        dead[0]["last_error_message"], dead[0]
    assert dead[0]["attempt_count"] == attempts, dead[0]
    assert "attempt %d of %d" % (attempts, attempts) in dead[0]["last_error_message"], dead[0]
    held = db.rows(where="aggregate_id = %s AND aggregate_version > %s",
                   params=(BAD, FAULT_VERSION))
    assert [r["status"] for r in held] == ["PENDING", "PENDING"], held
    assert all(r["attempt_count"] == 0 for r in held), held
    log = relay.log_text()
    assert "a fetch lost the connection: reading its rows one at a time" in log
    losses = log.count("database connection down")
    # per attempt one loss over a batch and one over the row alone, and a
    # round or so in which the row is given back unattempted while the
    # version before it is still with Kafka (one line per loss: the
    # connection comes back in between); without a bound, hundreds a minute
    assert attempts <= losses <= 4 * attempts, log[-3000:]
    audit = check_audit(db)
    assert not audit.violations, audit.violations[:10]
    table = db.rows()
    kc, problems = check_kafka(kafka, [topic], table, dup_allowed=audit.relocked_after_stale)
    assert not problems, problems
    on_kafka = {(header(m, "aggregate-id"), int(header(m, "aggregate-version"))) for m in kc.msgs}
    assert not {(BAD, v) for v in range(FAULT_VERSION, FAULT_VERSION + 3)} & on_kafka
    assert len(kc.ids) == len(healthy) + FAULT_VERSION - 1
    report("%s/%d, whose read ends the session, DEAD READ_FAILED after %d attempts and %d "
           "logged connection losses; %d-%d held with 0 attempts; %d other rows PUBLISHED, "
           "none DEAD; %d messages, order ok", BAD, FAULT_VERSION, attempts, losses,
           FAULT_VERSION + 1, FAULT_VERSION + 2, len(table) - len(bad), len(kc.msgs))
