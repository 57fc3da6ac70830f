"""outboxctl replay locks rows, never the table (docs/DESIGN.md, "Replaying"):
the application's INSERTs wait for no lock of a replay of 100k rows; a
step holds the rows it moves (PUBLISHING, for no relay) and makes them
PENDING in a second statement, which also replays a version published in
between (by a lock statement that began before the hold) or, when such a
version stays PUBLISHING, gives the held rows back as they were.

The race with relays and Kafka is tested in test_outboxctl.py ("replays
racing two relays and new versions committing"); here only the table
matters. The tests of the step's two halves pause between them with the
test hook OUTBOX_TEST_REPLAY_PAUSE_MS (skipped in builds without hooks)."""
import json
import os
import re
import subprocess
import threading
import time

import pytest

from harness import bin_path, wait_until

OUTBOXCTL = bin_path("outboxctl")


def ctl(db, *args, wait=True, **env):
    base = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    full = {**base, "OUTBOX_DATABASE_URL": db.pg.url, "OUTBOX_TABLE": db.table,
            **{k: str(v) for k, v in env.items()}}
    p = subprocess.Popen([OUTBOXCTL, *map(str, args)], env=full, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    if not wait:
        return p
    out, err = p.communicate(timeout=300)
    return p.returncode, out, err


def have_hooks():
    return "OUTBOX_TEST_REPLAY_PAUSE_MS" in subprocess.run(
        [OUTBOXCTL, "--help"], stdout=subprocess.PIPE, text=True).stdout


hooks = pytest.mark.skipif(not have_hooks(), reason="needs -DOUTBOX_TEST_HOOKS=ON")


def published(db, aggregates, versions, ago="10 minutes"):
    """aggregates x versions PUBLISHED rows, published `ago`."""
    db.execute("INSERT INTO %s (aggregate_type, aggregate_id, aggregate_version, event_type,"
               " payload_json, status, published_at)"
               " SELECT 'Order', 'a' || a, v, 'E', '{\"x\": 1}', 'PUBLISHED', now() - interval '%s'"
               " FROM generate_series(1, %d) a, generate_series(1, %d) v"
               % (db.table, ago, aggregates, versions))
    db.execute("ANALYZE %s" % db.table)


def lock_waits(pg, pid, offset):
    """The lock waits of backend `pid` that the server logged after byte
    `offset` of its log (log_lock_waits: waits of deadlock_timeout or more),
    in order: (what, ms), ms None for a wait that did not end in the lock."""
    with open(os.path.join(pg.dir, "server.log"), encoding="utf-8", errors="replace") as f:
        f.seek(offset)
        text = f.read()
    waits, pending = [], None
    for m in re.finditer(r"process %d (still waiting for|acquired) (.+?) after ([0-9.]+) ms"
                         % pid, text):
        if m.group(1) == "acquired":
            waits.append((m.group(2), float(m.group(3))))
            pending = None
        else:
            if pending:
                waits.append((pending, None))
            pending = m.group(2)
    if pending:
        waits.append((pending, None))
    return waits


def log_size(pg):
    return os.path.getsize(os.path.join(pg.dir, "server.log"))


def test_inserts_never_wait_for_a_replay(db):
    """A writer inserts continuously (the next version of the aggregates being
    replayed, and new aggregates), one transaction per row, while a replay of
    100k rows runs. The server logs every lock wait of the writer's session
    of 10 ms or more (log_lock_waits, deadlock_timeout 10 ms): none is for a
    lock the replay takes (the table's, a row's, a transaction's). What it
    may log is the relation extension lock, the server's own short lock for
    adding a page to a relation, which any two writers of a table share (the
    replay's updates add pages too): those waits are printed, and on a
    machine whose cores are shared with other work one can exceed 50 ms when
    the process holding it waits for a core. Each INSERT's time is measured:
    the median and p99 stay under 50 ms; the maximum is printed."""
    if not db.pg.dir:
        pytest.skip("needs the server's log (a server started by tests/run or the harness)")
    published(db, 10000, 10)
    stop = threading.Event()
    lat, errors, pid = [], [], []

    def writer():
        conn = db.pg.connect(options="-c log_lock_waits=on -c deadlock_timeout=10ms")
        n, nxt = 0, {}
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT pg_backend_pid()")
                pid.append(cur.fetchone()[0])
                while not stop.is_set():
                    n += 1
                    agg = "a%d" % (n * 7 % 10000 + 1) if n % 2 else "new%d" % n
                    v = nxt[agg] = nxt.get(agg, 10) + 1
                    t0 = time.perf_counter()
                    cur.execute("INSERT INTO %s (aggregate_type, aggregate_id, aggregate_version,"
                                " event_type, payload_json) VALUES ('Order', %%s, %%s, 'E', '{}')"
                                % db.table, (agg, v))
                    lat.append((time.perf_counter() - t0, time.monotonic()))
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)
        finally:
            conn.close()

    offset = log_size(db.pg)
    t = threading.Thread(target=writer)
    t.start()
    try:
        wait_until(lambda: len(lat) >= 50, 10, what="the writer inserting")
        start = time.monotonic()
        rc, out, err = ctl(db, "replay", "--since", "1h", "--json")
        end = time.monotonic()
    finally:
        stop.set()
        t.join()
    assert not errors, errors
    assert rc == 0, (out, err)
    res = json.loads(out)
    assert res["moved"] == 100000 and res["moved_aggregates"] == 10000, res
    waits = lock_waits(db.pg, pid[0], offset)
    replays = [w for w in waits if not w[0].startswith("ExclusiveLock on extension of")]
    assert not replays, "the writer waited for a lock of the replay: %s" % replays
    during = sorted(d for d, at in lat if start <= at <= end)
    assert len(during) >= 100, "the writer hardly ran during the replay: %d" % len(during)
    median, p99 = during[len(during) // 2], during[int(len(during) * 0.99)]
    print("replay of 100k rows: %.1f s; %d INSERTs meanwhile, median %.1f ms, p99 %.1f ms,"
          " max %.1f ms; lock waits of 10 ms or more: %s"
          % (end - start, len(during), 1000 * median, 1000 * p99, 1000 * during[-1],
             ", ".join("%s ms (relation extension)" % ms for _, ms in waits) or "none"))
    assert median < 0.050 and p99 < 0.050, (median, p99)
    # the replayed rows and everything the writer inserted are due, nothing held
    assert db.count("status <> 'PENDING'") == 0
    assert db.count("available_at > now() OR locked_by IS NOT NULL") == 0


@hooks
def test_rows_held_between_the_halves_are_not_due(db):
    published(db, 1, 5)
    # version 5 published by hand after it went DEAD as late: it keeps the code
    db.execute("UPDATE %s SET last_error_code = 'LATE_VERSION', last_error_message = 'late'"
               " WHERE aggregate_version = 5" % db.table)
    p = ctl(db, "replay", "--aggregate", "Order/a1", "--from-version", "3", wait=False,
            OUTBOX_TEST_REPLAY_PAUSE_MS=3000)
    try:
        wait_until(lambda: db.count("status = 'PUBLISHING'") == 3, 10, what="the hold")
        held = db.rows(where="status = 'PUBLISHING'", order_by="aggregate_version")
        assert [r["aggregate_version"] for r in held] == [3, 4, 5]
        # held as a relay holds rows: no lock statement takes them before the
        # second half, and to the guard they are unpublished
        assert all(r["locked_by"] == "outboxctl replay" for r in held), held
        assert all(r["published_at"] is None and r["attempt_count"] == 0 for r in held)
        # the guard skips a PUBLISHING row with the code (one locked to go
        # DEAD as late): a held row carries none
        assert all(r["last_error_code"] is None and r["last_error_message"] is None
                   for r in held), held
    finally:
        out, err = p.communicate(timeout=60)
    assert p.returncode == 0, (out, err)
    assert "replayed 3 row(s) of 1 aggregate(s)" in out, out
    assert db.count("status = 'PENDING' AND available_at <= now() AND locked_by IS NULL") == 3


@hooks
def test_version_published_between_the_halves_is_replayed_too(db):
    """A lock statement that began before the hold saw version 5 published and
    version 6 (committed just then) ready, and published 6: the second half
    replays 6 with 3-5, so nothing stays published above the replayed
    versions."""
    published(db, 1, 5)
    p = ctl(db, "replay", "--aggregate", "Order/a1", "--from-version", "3", "--json", wait=False,
            OUTBOX_TEST_REPLAY_PAUSE_MS=2000)
    try:
        wait_until(lambda: db.count("status = 'PUBLISHING'") == 3, 10, what="the hold")
        db.execute("INSERT INTO %s (aggregate_type, aggregate_id, aggregate_version, event_type,"
                   " status, published_at) VALUES ('Order', 'a1', 6, 'E', 'PUBLISHED', now())"
                   % db.table)
    finally:
        out, err = p.communicate(timeout=60)
    assert p.returncode == 0, (out, err)
    assert json.loads(out)["moved"] == 4, out
    rows = db.rows(where="aggregate_version >= 3", order_by="aggregate_version")
    assert [(r["aggregate_version"], r["status"]) for r in rows] == [
        (3, "PENDING"), (4, "PENDING"), (5, "PENDING"), (6, "PENDING")]
    assert db.count("available_at > now()") == 0


@hooks
def test_version_still_publishing_gives_the_held_rows_back(db):
    """Version 6 locked by such a lock statement (PUBLISHING) and never marked:
    the second half waits for it (10 s), then gives 3-5 back PUBLISHED as they
    were, and reports them refused. Marked PUBLISHED within the wait, it is
    replayed too."""
    published(db, 2, 5)
    # a1/5 published by hand after it went DEAD as late: the hold drops its
    # code (see test_rows_held_between_the_halves_are_not_due), the undo
    # gives it back
    db.execute("UPDATE %s SET last_error_code = 'LATE_VERSION', last_error_message = 'late'"
               " WHERE aggregate_id = 'a1' AND aggregate_version = 5" % db.table)
    before = {r["outbox_id"]: r for r in db.rows(where="aggregate_id = 'a1'")}
    for agg, mark_after in (("a1", None), ("a2", 1.0)):
        p = ctl(db, "replay", "--aggregate", "Order/%s" % agg, "--from-version", "3", "--json",
                wait=False, OUTBOX_TEST_REPLAY_PAUSE_MS=2000)
        try:
            wait_until(lambda: db.count("aggregate_id = %s AND status = 'PUBLISHING'", (agg,))
                       == 3, 10, what="the hold")
            db.execute("INSERT INTO %s (aggregate_type, aggregate_id, aggregate_version,"
                       " event_type, status, locked_by, locked_at) VALUES ('Order', %%s, 6, 'E',"
                       " 'PUBLISHING', 'r9', now())" % db.table, (agg,))
            if mark_after is not None:
                time.sleep(2 + mark_after)  # into the second half's wait
                db.execute("UPDATE %s SET status = 'PUBLISHED', published_at = now(),"
                           " locked_by = NULL, locked_at = NULL WHERE aggregate_id = %%s"
                           " AND aggregate_version = 6" % db.table, (agg,))
        finally:
            out, err = p.communicate(timeout=60)
        res = json.loads(out)
        if mark_after is None:
            assert p.returncode == 1, (out, err)
            assert res["moved"] == 0 and res["busy"] == 3 and res["refused"] == 3, res
            assert "rows given back" in err, err
            after = {r["outbox_id"]: r for r in db.rows(where="aggregate_id = 'a1'")}
            for oid, r in before.items():
                for col in ("status", "published_at", "available_at", "attempt_count",
                            "last_error_code", "last_error_message"):
                    assert after[oid][col] == r[col], (r["aggregate_version"], col)
        else:
            assert p.returncode == 0, (out, err)
            assert res["moved"] == 4, res
            assert db.count("aggregate_id = 'a2' AND status = 'PENDING'") == 4
