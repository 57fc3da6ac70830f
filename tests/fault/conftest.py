"""Fixtures and checks shared by the fault tests (docs/DESIGN.md G1-G5).

Every test works on its own schema (TestSchema) and topic prefix. On top of the
outbox table each test installs an *audit trigger* (install_audit) that records
every change of a row's status or lock holder, with the *actor* that made it:
each relay and sweeper connects with `options=-c outbox.actor=<name>` in its
database URL (actor_env), so the trigger knows which process ran the statement
without trusting the process's own story. check_audit() then replays each
row's history and fails on:

  - a row locked while another lock on it was neither marked nor reset (G3);
  - a lock taken by one process on behalf of another (locked_by != actor);
  - a lock whose locked_at is not its statement's time (the locking
    transaction's now(): the lock timeout counts from there, DESIGN "The
    sweeper");
  - a lock released by a process that did not hold it, except the sweeper's
    STALE_LOCK reset, and that only once the lock timeout has passed since the
    lock's locked_at (by the reset's own now(), the clock the sweeper compares);
  - a PUBLISHED row changing again (PUBLISHED is final until deletion), except
    by the operator (outboxctl): made PENDING, or held by a replay
    (docs/DESIGN.md, "Replaying": PUBLISHING under locked_by 'outboxctl
    replay', then PENDING, or PUBLISHED again when the replay gives it back);
    only the operator takes and releases such a hold.

Kafka is read back with read_topics; check_kafka() compares it with the table
(G1), checks first-copy order per partition (G2), and allows a duplicate only
for rows whose audit permits one (G3).

The broker is Apache Kafka (`kafka`: the single-node broker tests/run starts;
test_cluster.py starts three brokers of its own); librdkafka's mock cluster
(`own_kafka`, `mock_kafka`) only where a test needs what the real broker cannot
do on command. Each test module says which it uses and why.
"""
import collections
import datetime
import os
import sys
import threading
import time
import urllib.parse

import psycopg2
import psycopg2.extras
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "support"))

from fixtures import kafka, mock_kafka, no_leftover_processes, pg  # noqa: E402,F401  (by name)
from harness import (MockBroker, TestSchema, check_order, duplicates,  # noqa: E402
                     header, read_topics, wait_until)
from observe import register_markers, scrape  # noqa: E402


def pytest_configure(config):
    register_markers(config)


# Short timeouts so every fault resolves in seconds (docs/DESIGN.md defaults are minutes).
DELIVERY_TIMEOUT_MS = 3000
CLK_TCK = os.sysconf("SC_CLK_TCK")


# `kafka` (fixtures.py) is Apache Kafka: tests/run's single-node broker. A test
# that needs the broker slow or hung pauses it (kafka.paused(): SIGSTOP, then
# SIGCONT); such a module is listed in tests/CMakeLists.txt
# (OUTBOX_TESTS_PAUSE_BROKER), which gives it tests/run's second broker, one
# such module at a time, so no test beside it sees the pause.


@pytest.fixture
def own_kafka(tmp_path):
    """librdkafka's mock cluster, of the test's own: for tests that take every
    broker down and up on command (connections refused at once) or inject
    produce errors, which Apache Kafka cannot do on command."""
    with MockBroker(log_dir=str(tmp_path)) as b:
        yield b


@pytest.fixture
def db(pg, request):
    with TestSchema(pg, request.node.name[5:25]) as s:
        install_audit(s)
        yield s


@pytest.fixture
def report(request, capsys):
    """report(fmt, *args): prints a line of what the test checked, visible in
    the pytest/ctest output even when the test passes."""
    name = request.node.name

    def out(fmt, *args):
        line = "[%s] %s" % (name, fmt % args if args else fmt)
        with capsys.disabled():
            sys.stdout.write("\n" + line)
            sys.stdout.flush()
    return out


# ------------------------------------------------------------------ environment

def actor_url(url, actor):
    """The database URL with `options=-c outbox.actor=<actor>` added: the audit
    trigger reads it with current_setting('outbox.actor')."""
    opt = "options=" + urllib.parse.quote("-c outbox.actor=%s" % actor, safe="")
    return url + ("&" if "?" in url else "?") + opt


def actor_env(db, actor, **extra):
    env = {"OUTBOX_DATABASE_URL": actor_url(db.pg.url, actor), "OUTBOX_TABLE": db.table,
           "OUTBOX_HTTP_ADDR": "off", "OUTBOX_LOG_FORMAT": "text"}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def relay_env(db, kafka, relay_id, **extra):
    """A relay named relay_id (also its actor) with the fault suite's short
    timeouts and the test's topic prefix."""
    env = actor_env(db, relay_id,
                    OUTBOX_RELAY_ID=relay_id,
                    OUTBOX_KAFKA_BOOTSTRAP_SERVERS=kafka.bootstrap,
                    OUTBOX_KAFKA_DELIVERY_TIMEOUT_MS=DELIVERY_TIMEOUT_MS,
                    OUTBOX_POLL_INTERVAL_MS=100,
                    OUTBOX_KAFKA_RECONNECT_BACKOFF_MAX_MS=1000,
                    OUTBOX_BACKOFF_INITIAL_MS=200,
                    OUTBOX_BACKOFF_MAX_MS=1000,
                    OUTBOX_TOPIC_TEMPLATE="%s.{aggregate_type}" % db.schema)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def wait_with_producer(port, n, what, timeout=30):
    """Waits until the relay serving /metrics on `port` has at least n messages
    with its producer (librdkafka's statistics, each second): rows past their
    fetch, not between their lock and it."""
    wait_until(lambda: (scrape(port).value("outbox_kafka_queue_messages") or 0) >= n,
               timeout, interval=0.1, what=what)


def sweeper_env(db, name, **extra):
    env = actor_env(db, name, OUTBOX_RELAY_ID=name, OUTBOX_LOCK_TIMEOUT_S=3,
                    OUTBOX_SWEEP_INTERVAL_S=1, OUTBOX_RETENTION_S=0)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def write_out_of_order(db, rows, chunk=1000, delay=0.05, pause=0.0):
    """Inserts rows (in make_events order: version v of every aggregate, then
    v+1) in transactions of `chunk` rows and commits each pair of consecutive
    transactions in reverse order: the later versions of every aggregate in
    the pair become visible `delay` s before the earlier ones, which were
    inserted first (late commits, and gaps, on purpose); `pause` s between
    pairs. Returns the number of reversed pairs."""
    cols = ("aggregate_type", "aggregate_id", "aggregate_version", "event_type",
            "payload_json")
    sql = "INSERT INTO %s (%s) VALUES %%s" % (db.table, ", ".join(cols))

    def insert(conn, part):
        values = [tuple(psycopg2.extras.Json(r[c]) if c == "payload_json" else r[c]
                        for c in cols) for r in part]
        with conn.cursor() as cur:
            psycopg2.extras.execute_values(cur, sql, values, page_size=1000)

    pairs = 0
    for i in range(0, len(rows), 2 * chunk):
        early, late = rows[i:i + chunk], rows[i + chunk:i + 2 * chunk]
        c1, c2 = psycopg2.connect(db.pg.url), psycopg2.connect(db.pg.url)
        try:
            insert(c1, early)  # first to write: the older transaction
            if late:
                insert(c2, late)
                c2.commit()  # ... but the later versions commit first
                pairs += 1
                time.sleep(delay)
            c1.commit()
        finally:
            c1.close()
            c2.close()
        time.sleep(pause)
    return pairs


class Writer(threading.Thread):
    """Commits events on its own connection until stop(): every `period` s one
    transaction of `per_tx` rows, each the next version of one of `aggregates`
    aggregates (named prefix0, prefix1, ...) in turn. .inserted counts committed
    rows; .commits maps each row's outbox_id to the wall-clock time (time.time())
    at which its COMMIT returned."""

    def __init__(self, db, prefix, aggregates=60, per_tx=10, period=0.04):
        super().__init__(daemon=True)
        self.db, self.prefix = db, prefix
        self.aggregates, self.per_tx, self.period = aggregates, per_tx, period
        self.inserted = 0
        self.commits = {}
        self.error = None
        self._halt = threading.Event()
        self._versions = collections.Counter()
        self._next = 0

    def _rows(self):
        rows = []
        for _ in range(self.per_tx):
            agg = "%s%d" % (self.prefix, self._next % self.aggregates)
            self._next += 1
            self._versions[agg] += 1
            rows.append(("Order", agg, self._versions[agg], "Changed",
                          psycopg2.extras.Json({"agg": agg, "v": self._versions[agg]})))
        return rows

    def run(self):
        try:
            conn = psycopg2.connect(self.db.pg.url)
            with conn:
                while not self._halt.is_set():
                    rows = self._rows()
                    with conn.cursor() as cur:
                        ids = psycopg2.extras.execute_values(
                            cur, "INSERT INTO %s (aggregate_type, aggregate_id, "
                            "aggregate_version, event_type, payload_json) VALUES %%s "
                            "RETURNING outbox_id::text" % self.db.table, rows, fetch=True)
                    conn.commit()
                    now = time.time()
                    for (oid,) in ids:
                        self.commits[oid] = now
                    self.inserted += len(rows)
                    self._halt.wait(self.period)
            conn.close()
        except Exception as e:  # reported by stop()
            self.error = e

    def stop(self):
        self._halt.set()
        self.join(30)
        assert not self.is_alive(), "writer did not stop"
        assert self.error is None, "writer failed: %r" % self.error
        return self.inserted


def cpu_seconds(pid):
    """utime + stime of a process (and its threads) from /proc/<pid>/stat."""
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def reconnect(db):
    """After a server restart: a fresh connection for the test's TestSchema."""
    try:
        db.conn.close()
    except Exception:
        pass
    db.conn = db.pg.connect()
    return db


# ------------------------------------------------------------------ audit

AUDIT_SQL = """
CREATE TABLE {s}.lock_audit (
    seq            bigserial PRIMARY KEY,
    outbox_id      uuid NOT NULL,
    old_status     text,
    new_status     text,
    old_locked_by  text,
    new_locked_by  text,
    old_locked_at  timestamptz,
    new_locked_at  timestamptz,
    actor          text,
    code           text,
    attempt_count  int,
    available_at   timestamptz,
    xact_ts        timestamptz NOT NULL DEFAULT now(),  -- the changing transaction's start
    ts             timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE {s}.delete_audit (
    seq    bigserial PRIMARY KEY,
    actor  text,
    rows   bigint NOT NULL,
    bad    bigint NOT NULL,  -- deleted rows that were not PUBLISHED
    ts     timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE FUNCTION {s}.audit_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status IS DISTINCT FROM OLD.status OR NEW.locked_by IS DISTINCT FROM OLD.locked_by
    THEN
        INSERT INTO {s}.lock_audit (outbox_id, old_status, new_status, old_locked_by,
            new_locked_by, old_locked_at, new_locked_at, actor, code, attempt_count,
            available_at)
        VALUES (NEW.outbox_id, OLD.status, NEW.status, OLD.locked_by, NEW.locked_by,
            OLD.locked_at, NEW.locked_at, current_setting('outbox.actor', true),
            NEW.last_error_code, NEW.attempt_count, NEW.available_at);
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER audit_update AFTER UPDATE ON {s}.outbox_event
    FOR EACH ROW EXECUTE FUNCTION {s}.audit_update();
CREATE FUNCTION {s}.audit_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO {s}.delete_audit (actor, rows, bad)
    SELECT current_setting('outbox.actor', true), count(*),
           count(*) FILTER (WHERE status <> 'PUBLISHED') FROM gone;
    RETURN NULL;
END $$;
CREATE TRIGGER audit_delete AFTER DELETE ON {s}.outbox_event
    REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION {s}.audit_delete();
"""


def install_audit(db):
    db.execute(AUDIT_SQL.format(s=db.schema))


def audit_rows(db):
    return db.execute("SELECT *, outbox_id::text AS outbox_id FROM %s.lock_audit ORDER BY seq"
                      % db.schema)


class Audit:
    """The replayed audit: violations plus per-row facts the tests use."""

    def __init__(self):
        self.violations = []
        self.locks = collections.Counter()        # outbox_id -> number of locks
        self.stale_resets = collections.Counter()  # outbox_id -> STALE_LOCK resets
        self.relocked_after_stale = set()          # locked again after a STALE_LOCK reset
        self.releases = collections.Counter()      # (actor kind, new status) -> count
        # outbox_id -> locks given back unattempted (a later version of an aggregate
        # whose earlier version failed in the same batch, or a stop before its turn):
        # the relay restores attempt_count, so attempts = locks - unattempted.
        self.unattempted = collections.Counter()
        self.failed = []                            # audit rows of marks to FAILED by relays
        # relay id -> most rows it held at once (above OUTBOX_BATCH_SIZE: it
        # locked the next batch while publishing one)
        self.max_held = collections.Counter()

    @property
    def lock_count(self):
        return sum(self.locks.values())


# locked_by of the rows a replay holds between its two statements (common/db_admin.c)
REPLAY_HOLDER = "outboxctl replay"


def check_audit(db, lock_timeout_s=None, allow_actors=("operator",)):
    """Replays lock_audit (see the module docstring). Returns an Audit; the
    caller asserts not audit.violations."""
    a = Audit()
    holder = {}   # outbox_id -> (locked_by, locked_at, attempt_count)
    held_now = collections.Counter()  # relay id -> rows it holds at this point
    published = set()
    for r in audit_rows(db):
        oid, actor = r["outbox_id"], r["actor"]
        where = "audit#%d row %s" % (r["seq"], oid)
        replay_hold = (actor in allow_actors and r["new_status"] == "PUBLISHING"
                       and r["new_locked_by"] == REPLAY_HOLDER)
        if oid in published:
            if not (actor in allow_actors and r["new_status"] == "PENDING") and \
                    not (replay_hold and r["old_status"] == "PUBLISHED"):
                a.violations.append("%s: changed after PUBLISHED (%s -> %s by %s)"
                                    % (where, r["old_status"], r["new_status"], actor))
            published.discard(oid)
        if r["new_status"] == "PUBLISHING":
            if r["old_status"] == "PUBLISHING" or oid in holder:
                a.violations.append("%s: locked by %s while held by %s"
                                    % (where, r["new_locked_by"],
                                       holder.get(oid, (r["old_locked_by"],))[0]))
            if replay_hold and r["old_status"] != "PUBLISHED":
                a.violations.append("%s: a replay held a row that was %s"
                                    % (where, r["old_status"]))
            elif actor != r["new_locked_by"] and not replay_hold:
                a.violations.append("%s: %s took a lock for %s" % (where, actor,
                                                                   r["new_locked_by"]))
            # The lock's age counts from locked_at, which must be the
            # locking statement's now(): not earlier (the sweeper would take
            # the lock back before its time), not later (after the row was
            # locked).
            if r["new_locked_at"] is None or r["new_locked_at"] != r["xact_ts"]:
                a.violations.append("%s: locked_at %s is not the lock's transaction start %s"
                                    % (where, r["new_locked_at"], r["xact_ts"]))
            if a.stale_resets[oid]:
                a.relocked_after_stale.add(oid)
            holder[oid] = (r["new_locked_by"], r["new_locked_at"], r["attempt_count"])
            if not replay_hold:  # a relay's attempt
                a.locks[oid] += 1
            held_now[r["new_locked_by"]] += 1
            a.max_held[r["new_locked_by"]] = max(a.max_held[r["new_locked_by"]],
                                                 held_now[r["new_locked_by"]])
        elif r["old_status"] == "PUBLISHING":
            held = holder.pop(oid, None)
            if held is not None:
                held_now[held[0]] -= 1
            if held is None or held[0] != r["old_locked_by"]:
                a.violations.append("%s: released lock of %s that the audit never saw taken"
                                    % (where, r["old_locked_by"]))
            if r["code"] == "STALE_LOCK" and r["new_status"] in ("FAILED", "DEAD") and \
                    actor and actor.startswith("sweeper"):
                a.stale_resets[oid] += 1
                a.releases[("sweeper", "STALE_LOCK")] += 1
                if lock_timeout_s is not None and held is not None and held[1] is not None:
                    # by the clock the sweeper compares: its statement's now()
                    age = (r["xact_ts"] - held[1]).total_seconds()
                    if age < lock_timeout_s:
                        a.violations.append("%s: sweeper reset a lock %.3fs old (timeout %ds)"
                                            % (where, age, lock_timeout_s))
            elif actor in allow_actors and r["old_locked_by"] == REPLAY_HOLDER:
                # the replay's release (PENDING) or its giving back (PUBLISHED)
                if r["new_status"] not in ("PENDING", "PUBLISHED"):
                    a.violations.append("%s: %s moved a replay's held row to %s"
                                        % (where, actor, r["new_status"]))
                a.releases[("operator", r["new_status"])] += 1
            elif actor != r["old_locked_by"]:
                a.violations.append("%s: %s marked %s a row locked by %s"
                                    % (where, actor, r["new_status"], r["old_locked_by"]))
            elif held is not None and r["new_status"] in ("PENDING", "FAILED") and \
                    r["attempt_count"] == held[2] - 1:
                a.releases[("relay", "RELEASED")] += 1
                a.unattempted[oid] += 1
            else:
                a.releases[("relay", r["new_status"])] += 1
                if r["new_status"] == "FAILED":
                    a.failed.append(r)
            if r["new_status"] == "PUBLISHED":
                published.add(oid)
        elif actor not in allow_actors:
            a.violations.append("%s: %s moved %s -> %s outside a lock"
                                % (where, actor, r["old_status"], r["new_status"]))
    return a


# ------------------------------------------------------------------ kafka

def parse_ts(text):
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(
        tzinfo=datetime.timezone.utc)


class KafkaCheck:
    def __init__(self, msgs):
        self.msgs = msgs
        self.ids = collections.Counter(header(m, "event-id") for m in msgs)
        self.dups = duplicates(msgs)
        self.extra_copies = sum(n - 1 for n in self.dups.values())
        ok, self.order_violations = check_order(msgs)
        self.max_lag_s = 0.0
        for m in msgs:
            occurred = header(m, "occurred-at")
            if occurred and m.get("timestamp") is not None:
                lag = m["timestamp"] / 1000.0 - parse_ts(occurred).timestamp()
                self.max_lag_s = max(self.max_lag_s, lag)


def check_kafka(kafka, topics, rows, dup_allowed, timeout_s=60):
    """Reads the topics back and checks them against the table rows (dicts of
    db.rows()): every PUBLISHED row's event is there (G1), no event that is
    not a row, first-copy order per partition (G2), and duplicates only of
    ids in dup_allowed (G3). Returns (KafkaCheck, problems)."""
    kc = KafkaCheck(read_topics(kafka.bootstrap, topics=topics, timeout_s=timeout_s))
    problems = []
    table_ids = {r["outbox_id"] for r in rows}
    published = {r["outbox_id"] for r in rows if r["status"] == "PUBLISHED"}
    missing = published - set(kc.ids)
    if missing:
        problems.append("%d PUBLISHED rows not on Kafka, e.g. %s"
                        % (len(missing), sorted(missing)[:3]))
    strangers = set(kc.ids) - table_ids
    if strangers:
        problems.append("%d events on Kafka that are not rows, e.g. %s"
                        % (len(strangers), sorted(strangers, key=str)[:3]))
    bad_dups = set(kc.dups) - set(dup_allowed)
    if bad_dups:
        problems.append("%d events duplicated without a reason in the audit, e.g. %s"
                        % (len(bad_dups), sorted(bad_dups)[:3]))
    problems.extend(kc.order_violations[:10])
    return kc, problems


def db_lag_s(db):
    """Longest occurred_at -> published_at of PUBLISHED rows (seconds)."""
    rows = db.execute("SELECT coalesce(extract(epoch FROM max(published_at - occurred_at)), 0)"
                      "::float8 AS lag FROM %s WHERE status = 'PUBLISHED'" % db.table)
    return rows[0]["lag"]


def wait_quiet(db, timeout, what="all rows final"):
    """Waits until no row is PENDING, PUBLISHING or FAILED."""
    deadline = time.monotonic() + timeout
    while True:
        c = db.status_counts()
        if c["PENDING"] == c["PUBLISHING"] == c["FAILED"] == 0:
            return c
        if time.monotonic() > deadline:
            raise AssertionError("timed out after %.0fs waiting for %s: %s" % (timeout, what, c))
        time.sleep(0.1)
