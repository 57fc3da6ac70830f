"""Scenario 7: the sweeper's retention delete works in statements of at most
OUTBOX_DELETE_BATCH rows, deletes only PUBLISHED rows past retention and
touches nothing else; two sweepers at once split the work without errors,
deleting and resetting each row exactly once. Also: --once and loop mode,
metrics, clean SIGTERM, exit 2 on bad configuration. No broker: the sweeper
never talks to Kafka."""
import re
import signal
import time
import urllib.request

from conftest import actor_env
from observe import log_records, scrape
from harness import Relay, free_port, make_events, wait_until


def seed(db, prefix, n, status, age_s, **cols):
    """n rows of `status` whose timestamps lie age_s seconds in the past."""
    rows = make_events(aggregates=n, versions=1, id_prefix=prefix)
    ids = db.insert_events(rows)
    sets = ["status = %s", "created_at = now() - %s * interval '1 second'"]
    params = [status, age_s]
    if status == "PUBLISHED":
        sets.append("published_at = now() - %s * interval '1 second'")
        params.append(age_s)
    for col, value in cols.items():
        sets.append("%s = %%s" % col)
        params.append(value)
    db.execute("UPDATE %s SET %s WHERE outbox_id = ANY(%%s::uuid[])"
               % (db.table, ", ".join(sets)), params + [ids])
    return ids


def deletes(db):
    return db.execute("SELECT actor, rows, bad FROM %s.delete_audit ORDER BY seq" % db.schema)


def logged_totals(relay):
    text = relay.log_text()
    reset = sum(int(x) for x in re.findall(r'msg="sweep done" stale_reset=(\d+)', text))
    deleted = sum(int(x) for x in re.findall(r'msg="sweep done" .*?deleted=(\d+)', text))
    return reset, deleted


def metric(port, name):
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=2) as r:
        text = r.read().decode()
    m = re.search(r"^%s (\S+)$" % re.escape(name), text, re.M)
    return float(m.group(1)) if m else None


def test_retention_deletes_in_batches_and_nothing_else(db, tmp_path, report):
    old = seed(db, "old", 2500, "PUBLISHED", 7200)
    seed(db, "recent", 200, "PUBLISHED", 600)
    seed(db, "pend", 50, "PENDING", 7200)
    seed(db, "fail", 30, "FAILED", 7200, last_error_code="_MSG_TIMED_OUT")
    seed(db, "dead", 20, "DEAD", 7200, last_error_code="MSG_SIZE_TOO_LARGE")
    seed(db, "held", 10, "PUBLISHING", 60, locked_by="live-relay",
         locked_at=time.strftime("%Y-%m-%d %H:%M:%S+00", time.gmtime()))
    keep = {r["outbox_id"]: r for r in db.rows(where="NOT (outbox_id = ANY(%s::uuid[]))",
                                             params=(old,))}
    env = actor_env(db, "sweeper-once", OUTBOX_RETENTION_S=3600, OUTBOX_DELETE_BATCH=100,
                    OUTBOX_LOCK_TIMEOUT_S=300)
    once = Relay("outbox-sweeper", name="sweeper-once", args=["--once"], log_dir=tmp_path,
                 env=env)
    assert once.wait(60) == 0, once.log_text()[-2000:]
    stmts = deletes(db)
    assert sum(s["rows"] for s in stmts) == 2500
    assert all(s["rows"] <= 100 and s["bad"] == 0 and s["actor"] == "sweeper-once"
               for s in stmts), stmts
    assert len(stmts) >= 25
    after = {r["outbox_id"]: r for r in db.rows()}
    assert after == keep, "rows other than old PUBLISHED ones changed"
    assert logged_totals(once) == (0, 2500)

    # Loop mode: later rows are swept on the next turn, metrics count them,
    # SIGTERM stops it at once with 0.
    port = free_port()
    loop = Relay("outbox-sweeper", name="sweeper-loop", log_dir=tmp_path,
                 env={**env, "OUTBOX_SWEEP_INTERVAL_S": 1, "OUTBOX_RELAY_ID": "sweeper-loop",
                      "OUTBOX_HTTP_ADDR": "127.0.0.1:%d" % port})
    wait_until(lambda: metric(port, "outbox_sweeper_rows_deleted_total") is not None, 20,
               what="sweeper /metrics")
    seed(db, "late", 250, "PUBLISHED", 7200)
    wait_until(lambda: metric(port, "outbox_sweeper_rows_deleted_total") == 250, 20,
               what="the loop deleting late rows")
    t0 = time.monotonic()
    assert loop.stop(signal.SIGTERM, timeout=10) == 0
    stop_s = time.monotonic() - t0
    assert stop_s < 2, stop_s
    assert {r["outbox_id"] for r in db.rows()} == set(keep)

    bad = Relay("outbox-sweeper", name="sweeper-bad", log_dir=tmp_path,
                env={**env, "OUTBOX_DELETE_BATCH": "0"})
    assert bad.wait(20) == 2 and "OUTBOX_DELETE_BATCH" in bad.log_text()
    report("--once: 2500 of 2810 rows past retention deleted in %d statements of <= 100 "
           "(max %d), 0 non-PUBLISHED deleted, the other 310 rows (recent PUBLISHED, PENDING, "
           "FAILED, DEAD, held PUBLISHING) unchanged; loop: 250 more deleted, metric %s, "
           "SIGTERM exit 0 in %.2fs; bad config exit 2",
           len(stmts), max(s["rows"] for s in stmts), 250, stop_s)


def test_two_sweepers_at_once(db, tmp_path, report):
    seed(db, "old", 6000, "PUBLISHED", 7200)
    seed(db, "recent", 100, "PUBLISHED", 60)
    # A relay locks a row only once it is due: available_at <= locked_at.
    stale = seed(db, "stale", 400, "PUBLISHING", 3600, locked_by="ghost-relay",
                 locked_at="2000-01-01 00:00:00+00", available_at="2000-01-01 00:00:00+00")
    sweepers = [Relay("outbox-sweeper", name="sweeper-%s" % x, log_dir=tmp_path,
                      env=actor_env(db, "sweeper-%s" % x, OUTBOX_RELAY_ID="sweeper-%s" % x,
                                    OUTBOX_RETENTION_S=3600, OUTBOX_DELETE_BATCH=150,
                                    OUTBOX_LOCK_TIMEOUT_S=60, OUTBOX_SWEEP_INTERVAL_S=1))
                for x in ("a", "b")]
    try:
        wait_until(lambda: db.count() == 500 and db.count("status = 'PUBLISHING'") == 0, 60,
                   what="both sweepers done")
        wait_until(lambda: sum(logged_totals(s)[1] for s in sweepers) == 6000, 10,
                   what="sweepers logging their work")
    finally:
        codes = [s.stop() for s in sweepers]
    assert codes == [0, 0]
    for s in sweepers:
        assert "sweep failed" not in s.log_text(), s.log_text()[-2000:]
    stmts = deletes(db)
    assert sum(s["rows"] for s in stmts) == 6000 and all(s["bad"] == 0 for s in stmts)
    assert all(s["rows"] <= 150 for s in stmts)
    resets = db.execute("SELECT outbox_id::text AS id, actor, code FROM %s.lock_audit "
                        "WHERE old_status = 'PUBLISHING'" % db.schema)
    assert sorted(r["id"] for r in resets) == sorted(stale), "each stale row reset once"
    assert all(r["code"] == "STALE_LOCK" for r in resets)
    failed = db.rows(where="status = 'FAILED'")
    assert len(failed) == 400 and all(r["locked_by"] is None and r["last_error_code"] ==
                                      "STALE_LOCK" for r in failed)
    totals = {s.name: logged_totals(s) for s in sweepers}
    assert sum(t[0] for t in totals.values()) == 400
    by_actor = {}
    for s in stmts:
        by_actor[s["actor"]] = by_actor.get(s["actor"], 0) + s["rows"]
    report("two sweepers: 6000 old PUBLISHED deleted in %d statements (<= 150 rows, by actor "
           "%s), 400 stale locks reset exactly once (logged stale_reset/deleted per sweeper "
           "%s), 100 recent rows kept, no errors, both exit 0",
           len(stmts), by_actor, totals)


def test_sweeper_names_missing_indexes_it_reads(db, tmp_path):
    """The sweeper checks the indexes its statements read (common/sql/
    indexes.sql) once a process and again when a statement starts to time
    out, and names each one missing with the file that defines it: without
    them its statements read far more of the table. Only the indexes it
    reads: the retention index with retention on, the published guard index
    when it keeps each aggregate's latest row."""
    def findings(sweeper):
        return [(r["level"], r["msg"].split(":")[0], r["index"], r.get("file"))
                for r in log_records(sweeper.log_text()) if "index" in r]

    def once(name, **extra):
        settings = {"OUTBOX_RETENTION_S": 3600, "OUTBOX_LOCK_TIMEOUT_S": 300,
                    "OUTBOX_RETENTION_KEEP_LATEST": "true", **extra}
        env = actor_env(db, name, **settings)
        s = Relay("outbox-sweeper", name=name, args=["--once"], log_dir=tmp_path, env=env)
        assert s.wait(60) == 0, s.log_text()[-2000:]
        return s

    seed(db, "old", 20, "PUBLISHED", 7200)
    assert findings(once("sweeper-clean")) == []
    db.execute("DROP INDEX %s.outbox_event_retention_idx" % db.schema)
    db.execute("DROP INDEX %s.outbox_event_agg_published_idx" % db.schema)
    missing = [("warn", "index missing", "outbox_event_retention_idx",
                "schemas/postgres/001_outbox_event.sql"),
               ("warn", "index missing", "outbox_event_agg_published_idx",
                "schemas/postgres/007_guard_split.sql")]
    assert sorted(findings(once("sweeper-missing"))) == sorted(missing)
    # without keeping the latest rows the guard index is not read; without
    # retention neither is the retention index
    assert findings(once("sweeper-plain", OUTBOX_RETENTION_KEEP_LATEST="false")) == missing[:1]
    assert findings(once("sweeper-no-retention", OUTBOX_RETENTION_S=0)) == []

    # sweeps that start to time out (the stale-lock statement waits for a
    # table lock longer than its statement timeout) check again, once for
    # the whole run of timeouts; the failure is logged when it starts and
    # when it ends, not at every sweep
    holder = db.pg.connect()
    holder.autocommit = False
    port = free_port()
    env = actor_env(db, "sweeper-loop", OUTBOX_RETENTION_S=3600, OUTBOX_SWEEP_INTERVAL_S=1,
                    OUTBOX_LOCK_TIMEOUT_S=300, OUTBOX_RETENTION_KEEP_LATEST="false",
                    OUTBOX_STATEMENT_TIMEOUT_MS=100, OUTBOX_DB_LOCK_TIMEOUT_MS=60000,
                    OUTBOX_HTTP_ADDR="127.0.0.1:%d" % port)

    def timeouts():
        return scrape(port).total("outbox_statement_errors_total", sqlstate="57014")

    def lines(msg):
        return [r for r in log_records(s.log_text()) if r.get("msg") == msg]
    try:
        with Relay("outbox-sweeper", name="sweeper-loop", log_dir=tmp_path, env=env) as s:
            wait_until(lambda: findings(s) == missing[:1], 20, what="the check at start")
            with holder.cursor() as cur:
                cur.execute("LOCK TABLE %s IN SHARE MODE" % db.table)
            wait_until(lambda: timeouts() >= 4, 30, what="sweeps timing out")
            holder.commit()
            wait_until(lambda: lines("sweep works again"), 20, what="a sweep completing")
            assert findings(s) == missing[:1] * 2
            # one line per cause, not per sweep: a sweep under way when the
            # lock came times out in a later statement than the next ones do
            failed = lines("sweep failed")
            assert failed and all("statement timeout" in f["err"] for f in failed), failed
            assert len({f["err"] for f in failed}) == len(failed) <= 2, failed
            assert s.stop() == 0
    finally:
        holder.close()
