"""Scenario 10 (G4 at scale): the versions waiting behind a DEAD version of
their aggregate can never go before an operator acts, yet they would be due:
every lock statement would step over them, and enough of them would fill its
window and stop the table. The relay's lock statement parks those it meets, and
the sweeper those no relay met, out of the lock scan's range (available_at
'infinity', last_error_code BLOCKED); the sweeper makes them due again once no
DEAD version of their aggregate is below them: requeued, deleted or published
by hand. Nothing is lost and G2 holds on Kafka through it all.

Broker: Apache Kafka (tests/run's)."""
import re
import time

import psycopg2
import pytest

from conftest import actor_env, check_audit, check_kafka, relay_env
from harness import Relay, header, make_events, wait_until
from test_poison import row
from test_requeue import outboxctl

BLOCKED = ("status = 'PENDING' AND available_at = 'infinity'"
           " AND last_error_code = 'BLOCKED'")


def sweep(db, tmp_path, name, **extra):
    """One `outbox-sweeper --once`; returns (parked, unparked) from its log."""
    env = actor_env(db, name, OUTBOX_RELAY_ID=name, OUTBOX_RETENTION_S=0,
                    OUTBOX_DELETE_BATCH=100, **extra)
    s = Relay("outbox-sweeper", name=name, args=["--once"], log_dir=tmp_path, env=env)
    assert s.wait(60) == 0, s.log_text()[-2000:]
    log = s.log_text()
    m = re.search(r'msg="sweep done" .*? parked=(\d+) unparked=(\d+)', log)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def test_versions_behind_a_dead_version_are_parked_and_released(db, kafka, tmp_path, report):
    topic = "%s.Order" % db.schema
    kafka.create_topic(topic, 4)
    hot = [row("hot", 1, headers_json="[1]")] + [row("hot", v) for v in range(2, 302)]
    healthy = make_events(aggregates=20, versions=3, id_prefix="ok")
    ids = db.insert_events(hot + healthy)
    with Relay("outbox-relay", name="r-park", log_dir=tmp_path,
               env=relay_env(db, kafka, "r-park")) as relay:
        # The relay's lock statement parks hot/2..301 as soon as it sees them
        # behind the DEAD hot/1, and touches nothing else.
        wait_until(lambda: db.count("status = 'DEAD'") == 1 and
                   db.count("status = 'PUBLISHED'") == len(healthy) and
                   db.count(BLOCKED) == 300, 60,
                   what="hot/1 DEAD, the healthy aggregates PUBLISHED, hot/2..301 parked")
        assert db.count("aggregate_id = 'hot' AND aggregate_version > 1 AND NOT (%s)"
                        % BLOCKED) == 0
        (parked,) = db.rows(where="aggregate_id = 'hot' AND aggregate_version = 2")
        assert "DEAD version" in parked["last_error_message"], parked
        assert parked["attempt_count"] == 0
        assert parked["locked_by"] is None
        before = {r["outbox_id"]: r for r in db.rows(where="aggregate_id <> 'hot'")}
        assert sweep(db, tmp_path, "sweeper-park") == (0, 0)  # nothing left to do
        assert {r["outbox_id"]: r for r in db.rows(where="aggregate_id <> 'hot'")} == before

        # Versions that arrive later are parked as the relay comes to them.
        db.insert_events([row("hot", v) for v in range(302, 305)])
        wait_until(lambda: db.count(BLOCKED) == 303, 30, what="hot/302..304 parked")
        assert re.search(r'msg="versions parked behind a DEAD version of their aggregate" '
                         r'rows=\d+', relay.log_text())

        # A requeue that forgets available_at still fails on the constraint:
        # only BLOCKED versions may wait at 'infinity'.
        with pytest.raises(psycopg2.errors.CheckViolation, match="outbox_event_parked_check"):
            db.execute("UPDATE %s SET status = 'PENDING' WHERE outbox_id = %%s" % db.table,
                       (ids[0],))

        # The operator fixes hot/1 and requeues it: outboxctl makes the parked
        # versions due at once, and the relay publishes the aggregate in order.
        db.execute("UPDATE %s SET headers_json = '{}' WHERE outbox_id = %%s" % db.table,
                   (ids[0],))
        out = outboxctl(db, "requeue", "--id", ids[0])
        assert "requeued 1 row(s), 303 parked version(s) due again" in out, out
        assert sweep(db, tmp_path, "sweeper-unpark") == (0, 0)
        total = len(hot) + 3 + len(healthy)
        wait_until(lambda: db.count("status = 'PUBLISHED'") == total, 60,
                   what="every row PUBLISHED after the requeue")
        assert db.count("available_at = 'infinity'") == 0
        assert relay.stop() == 0

    table = db.rows()
    assert not any(r["last_error_code"] == "BLOCKED" for r in table)
    audit = check_audit(db)
    assert not audit.violations, audit.violations[:10]
    kc, problems = check_kafka(kafka, [topic], table, dup_allowed=set())
    assert not problems, problems  # G2: first copies in version order
    versions = [int(header(m, "aggregate-version")) for m in kc.msgs if m["key"] == "hot"]
    assert versions == list(range(1, 305)), versions[:20]
    report("hot/1 DEAD with 300 versions behind it: the relay parked them (3 more that "
           "arrived later as it came to them), left every other row alone; `outboxctl requeue` "
           "made all 303 due again; Kafka has hot 1..304 in order, %d messages, "
           "no duplicates", len(kc.msgs))


def test_versions_behind_a_dead_version_do_not_stall_the_table(db, kafka, tmp_path, report):
    # Far more versions wait behind the DEAD one than a lock statement takes,
    # and they are due before every other row: were they left in the lock's
    # window, they would fill it and nothing else would go. No sweeper runs.
    topic = "%s.Order" % db.schema
    kafka.create_topic(topic, 4)
    batch = 20
    db.insert_events([row("hot", 1, headers_json="[1]")] +
                     [row("hot", v) for v in range(2, 10 * batch + 2)])
    with Relay("outbox-relay", name="r-stall", log_dir=tmp_path,
               env=relay_env(db, kafka, "r-stall", OUTBOX_BATCH_SIZE=batch)) as relay:
        # hot/1's run is given back in a mark of its own, after the DEAD one
        wait_until(lambda: db.count("status = 'DEAD'") == 1 and
                   db.count("status = 'PUBLISHING'") == 0, 30, what="hot/1 DEAD, nothing locked")
        healthy = make_events(aggregates=10, versions=3, id_prefix="ok")
        t0 = time.monotonic()
        db.insert_events(healthy)
        wait_until(lambda: db.count("status = 'PUBLISHED'") == len(healthy), 30,
                   what="the rows inserted after the DEAD one PUBLISHED")
        took = time.monotonic() - t0
        wait_until(lambda: db.count(BLOCKED) == 10 * batch, 30, what="hot/2.. parked")

        # Requeued by SQL, and still no sweeper: the relay makes the parked
        # versions due again after its next table sample.
        (dead,) = db.rows(where="status = 'DEAD'")
        db.execute("UPDATE %s SET status = 'PENDING', available_at = now(), headers_json = '{}',"
                   " last_error_code = NULL, last_error_message = NULL, attempt_count = 0"
                   " WHERE outbox_id = %%s" % db.table, (dead["outbox_id"],))
        t1 = time.monotonic()
        total = 10 * batch + 1 + len(healthy)
        wait_until(lambda: db.count("status = 'PUBLISHED'") == total, 60,
                   what="hot/1..%d PUBLISHED after a requeue by SQL" % (10 * batch + 1))
        unparked = time.monotonic() - t1
        assert re.search(r'msg="parked versions due again" rows=%d' % (10 * batch),
                         relay.log_text())
        assert relay.stop() == 0
    table = db.rows()
    kc, problems = check_kafka(kafka, [topic], table, dup_allowed=set())
    assert not problems, problems
    versions = [int(header(m, "aggregate-version")) for m in kc.msgs if m["key"] == "hot"]
    assert versions == list(range(1, 10 * batch + 2)), versions[:20]
    report("hot/1 DEAD with %d versions behind it (10 lock batches); %d rows inserted after "
           "it PUBLISHED %.1f s later, no sweeper, the versions behind hot/1 parked by the "
           "relay; after a requeue by SQL the relay made them due again and hot 1..%d was on "
           "Kafka in order %.1f s later", 10 * batch, len(healthy), took, 10 * batch + 1,
           unparked)


LATE = ("status = 'DEAD' AND available_at = 'infinity' AND last_error_code = 'LATE_VERSION'"
        " AND attempt_count = 1")


def test_versions_above_a_late_version_are_not_held_by_it(db, kafka, tmp_path, report):
    # A LATE_VERSION row holds nothing (its place in the order is lost), also
    # once retention deleted the published versions around it: "gone" keeps
    # only its late version 3, and 3 lock batches of versions above it are
    # due before every other row. Were the late row taken as the previous
    # version, they would wait for it for good, fill the lock window and stop
    # the table. "held" keeps version 2: versions 3 (late) and 4 (deleted)
    # are a gap before its version 5, which an operator sees and releases.
    topic = "%s.Order" % db.schema
    kafka.create_topic(topic, 4)
    batch = 20
    top = 5 + 3 * batch
    ids = db.insert_events([row("gone", 3), row("held", 2), row("held", 3)])
    db.execute("UPDATE %s SET status = 'DEAD', available_at = 'infinity', attempt_count = 1,"
               " last_error_code = 'LATE_VERSION', last_error_message = 'version 3 committed"
               " after version 4 was published' WHERE outbox_id = ANY(%%s::uuid[])"
               % db.table, ([ids[0], ids[2]],))
    db.execute("UPDATE %s SET status = 'PUBLISHED', published_at = now() WHERE outbox_id = %%s"
               % db.table, (ids[1],))
    db.insert_events([row("gone", v) for v in range(5, top)] + [row("held", 5)])
    with Relay("outbox-relay", name="r-late", log_dir=tmp_path,
               env=relay_env(db, kafka, "r-late", OUTBOX_BATCH_SIZE=batch)) as relay:
        healthy = make_events(aggregates=10, versions=3, id_prefix="ok")
        t0 = time.monotonic()
        db.insert_events(healthy)
        wait_until(lambda: db.count("status = 'PUBLISHED' AND aggregate_id LIKE 'ok%%'")
                   == len(healthy) and
                   db.count("status = 'PUBLISHED' AND aggregate_id = 'gone'") == top - 5, 30,
                   what="gone/5..%d and the rows inserted after them PUBLISHED" % (top - 1))
        took = time.monotonic() - t0
        assert db.count(LATE) == 2
        # held/5 waits for versions 3-4, listed as a gap; released, it goes.
        listed = outboxctl(db, "gaps")
        assert "Order/held" in listed and "3-4" in listed and "gone" not in listed, listed
        released = outboxctl(db, "release-gap", "--aggregate", "Order/held")
        assert released.strip().startswith("released 3-4"), released
        wait_until(lambda: db.count("status = 'PUBLISHED' AND aggregate_id = 'held'") == 3, 30,
                   what="held/5 PUBLISHED after the release")
        assert relay.stop() == 0
    table = db.rows()
    assert db.count(LATE) == 2
    # held/2 was PUBLISHED by hand and held/4 is the release's record: neither
    # was sent
    sent = [r for r in table if r["aggregate_id"] != "held" or r["aggregate_version"] == 5]
    kc, problems = check_kafka(kafka, [topic], sent, dup_allowed=set())
    assert not problems, problems
    for agg, want in (("gone", list(range(5, top))), ("held", [5])):
        got = [int(header(m, "aggregate-version")) for m in kc.msgs if m["key"] == agg]
        assert got == want, (agg, got[:20])
    report("versions 5..%d of an aggregate whose only other row is its LATE_VERSION version 3 "
           "(%d lock batches, due first): on Kafka in order, and %d rows inserted after them "
           "PUBLISHED %.1f s after their insert; a gap behind a late version listed and "
           "released", top - 1, 3, len(healthy), took)


def test_parked_versions_return_when_their_dead_version_is_gone(db, tmp_path):
    # No relay: the rows are set up by hand as a relay would leave them.
    ids = db.insert_events([row("gone", v) for v in (1, 2, 3)] +
                           [row("kept", v) for v in (1, 2)])
    db.execute("UPDATE %s SET status = 'DEAD', available_at = 'infinity',"
               " last_error_code = 'INVALID_HEADERS', attempt_count = 1"
               " WHERE outbox_id = ANY(%%s::uuid[])" % db.table, ([ids[0], ids[3]],))
    assert sweep(db, tmp_path, "sweeper-1") == (3, 0)
    assert db.count(BLOCKED) == 3

    # Deleted by hand: gone/2 and gone/3 are due again; kept/2 stays parked.
    db.execute("DELETE FROM %s WHERE outbox_id = %%s" % db.table, (ids[0],))
    assert sweep(db, tmp_path, "sweeper-2") == (0, 2)
    due = db.rows(where="available_at <= now() AND status = 'PENDING'")
    assert sorted(r["aggregate_version"] for r in due) == [2, 3]
    assert all(r["last_error_code"] is None and r["aggregate_id"] == "gone" for r in due)
    assert db.count(BLOCKED) == 1

    # Under OUTBOX_ORDERING=none nothing blocks: the sweeper parks nothing and
    # returns what an earlier, ordered setup parked.
    assert sweep(db, tmp_path, "sweeper-none", OUTBOX_ORDERING="none") == (0, 1)
    assert db.count("available_at = 'infinity'") == 1  # only the DEAD kept/1


def test_only_versions_with_no_dead_version_below_them_return(db, tmp_path):
    # Two DEAD versions in one aggregate (possible after edits by hand, or
    # after running with OUTBOX_ORDERING=none): a parked version returns once
    # no DEAD version is below it, not before, and not only when all are gone.
    ids = db.insert_events([row("two", v) for v in (1, 2, 3, 4)])
    for i, code in ((0, "INVALID_HEADERS"), (2, "MSG_SIZE_TOO_LARGE")):
        db.execute("UPDATE %s SET status = 'DEAD', available_at = 'infinity',"
                   " last_error_code = %%s, attempt_count = 1 WHERE outbox_id = %%s"
                   % db.table, (code, ids[i]))
    assert sweep(db, tmp_path, "sweeper-1") == (2, 0)  # two/2 and two/4
    # The requeue frees nothing at once: two/3 is still DEAD in that aggregate.
    out = outboxctl(db, "requeue", "--all-dead", "--code", "INVALID_HEADERS")
    assert out.strip() == "requeued 1 row(s)", out
    assert sweep(db, tmp_path, "sweeper-2") == (0, 1)  # two/2: nothing DEAD below it
    parked = db.rows(where=BLOCKED)
    assert [r["aggregate_version"] for r in parked] == [4]


def test_a_late_version_does_not_keep_parked_versions_parked(db, tmp_path):
    # mix/1 is LATE_VERSION (it holds nothing), mix/2 DEAD for its content:
    # the sweeper parks mix/3 behind mix/2, and requeueing mix/2 frees it.
    ids = db.insert_events([row("mix", v) for v in (1, 2, 3)])
    for i, code in ((0, "LATE_VERSION"), (1, "INVALID_HEADERS")):
        db.execute("UPDATE %s SET status = 'DEAD', available_at = 'infinity',"
                   " last_error_code = %%s, attempt_count = 1 WHERE outbox_id = %%s"
                   % db.table, (code, ids[i]))
    assert sweep(db, tmp_path, "sweeper-1") == (1, 0)
    out = outboxctl(db, "requeue", "--id", ids[1])
    assert out.strip() == "requeued 1 row(s), 1 parked version(s) due again", out
    due = db.rows(where="available_at <= now() AND status = 'PENDING'")
    assert sorted(r["aggregate_version"] for r in due) == [2, 3], due
    assert db.count(BLOCKED) == 0


def test_a_table_without_the_003_check_still_gets_its_retention(db, tmp_path):
    # A sweeper upgraded before 003_park_blocked.sql widened the check: every
    # park statement fails on the old check. The sweep logs it and goes on.
    db.execute("ALTER TABLE %s DROP CONSTRAINT outbox_event_parked_check,"
               " ADD CONSTRAINT outbox_event_parked_check CHECK (status NOT IN"
               " ('PENDING', 'FAILED', 'PUBLISHING') OR available_at <> 'infinity')" % db.table)
    ids = db.insert_events([row("old", v) for v in (1, 2)] + [row("done", 1)])
    db.execute("UPDATE %s SET status = 'DEAD', available_at = 'infinity' WHERE outbox_id = %%s"
               % db.table, (ids[0],))
    db.execute("UPDATE %s SET status = 'PUBLISHED', published_at = now() - interval '2 hours'"
               " WHERE outbox_id = %%s" % db.table, (ids[2],))
    env = actor_env(db, "sweeper-old", OUTBOX_RELAY_ID="sweeper-old", OUTBOX_RETENTION_S=3600)
    s = Relay("outbox-sweeper", name="sweeper-old", args=["--once"], log_dir=tmp_path, env=env)
    assert s.wait(60) == 0, s.log_text()[-2000:]
    assert re.search(r'msg="parking failed, going on" err=.*outbox_event_parked_check',
                     s.log_text()), s.log_text()[-2000:]
    assert db.count("outbox_id = %s", (ids[2],)) == 0  # retention ran
    assert db.count(BLOCKED) == 0 and db.count("status = 'PENDING'") == 1
