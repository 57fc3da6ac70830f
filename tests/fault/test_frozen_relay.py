"""A relay frozen (SIGSTOP) at any point holds no row for longer than the
sweeper's lock timeout plus a stated bound; another relay publishes them
(G1, G2 on Apache Kafka), and once the frozen one runs again nothing goes out
twice beyond what at-least-once allows (G3: only rows whose lock the sweeper
took back may be on Kafka twice).

The three points, each with relay A frozen, then relay B and a sweeper
(OUTBOX_LOCK_TIMEOUT_S = LOCK_TIMEOUT_S) started:
  - mid lock statement: A's lock statement pauses (OUTBOX_TEST_LOCK_DELAY_MS)
    and A is stopped during the pause; the server goes on, locks the rows
    (50 KB each) and must end the statement's transaction while A reads
    nothing: the answer is ids and sizes, not content, so it fits in the
    socket buffers and the statement commits (a larger answer would leave the
    server writing it inside the transaction until tcp_user_timeout cut A
    off). A never learns which rows it holds; the sweeper takes them back
    once their locked_at (the statement's start, before the pause) is
    LOCK_TIMEOUT_S old;
  - mid produce: A publishes, the broker is stopped (SIGSTOP) while A's
    produce requests are in flight, A is stopped while it owes delivery
    reports, then the broker resumes (and appends what A had sent);
  - mid mark: A's mark statements pause (OUTBOX_TEST_MARK_DELAY_MS) and A is
    stopped during the pause.
Needs a build with -DOUTBOX_TEST_HOOKS=ON (tests/run's sanitized build)."""
import signal
import time

import pytest

from conftest import check_audit, check_kafka, relay_env, sweeper_env
from harness import Relay, make_events, wait_until
from observe import NEW_CORE

LOCK_TIMEOUT_S = 5         # the sweeper's OUTBOX_LOCK_TIMEOUT_S
SWEEP_INTERVAL_S = 1       # the sweeper's OUTBOX_SWEEP_INTERVAL_S
STATEMENT_TIMEOUT_MS = 3000  # the relays' OUTBOX_STATEMENT_TIMEOUT_MS
DRAIN_S = 10               # relay B alone publishes every row of a test in less
# The bound, from the moment A is frozen until every row it held is
# PUBLISHED by B. A row A holds is released in one of two ways:
#   - A's lock statement had not committed: the server must end that
#     transaction itself within A's statement timeout (the relay's sessions
#     set statement_timeout, and tcp_user_timeout/keepalives against a client
#     that does not read its answer);
#   - the row is PUBLISHING under A: the sweeper returns it once the lock is
#     LOCK_TIMEOUT_S old, at its next sweep (SWEEP_INTERVAL_S later).
# Then B (polling every 100 ms; a STALE_LOCK row is due at once) publishes
# it and the rest within DRAIN_S.
HOLD_BOUND_S = LOCK_TIMEOUT_S + STATEMENT_TIMEOUT_MS / 1000 + SWEEP_INTERVAL_S + DRAIN_S
AFTER_CONTINUE_S = 3       # how long the thawed A runs before it is stopped
LOCK_DELAY_MS = 1500       # mid lock statement: A's lock statements pause this long

RELAY_SETTINGS = dict(OUTBOX_STATEMENT_TIMEOUT_MS=STATEMENT_TIMEOUT_MS,
                      OUTBOX_DB_LOCK_TIMEOUT_MS=1000,
                      OUTBOX_BATCH_BYTES=64 * 1024 * 1024)

SLEEPING = ("SELECT pid, query FROM pg_stat_activity WHERE wait_event = 'PgSleep'"
            " AND application_name LIKE 'outbox-relay%%' AND state = 'active'"
            " AND query LIKE %s")
STATE = ("SELECT pid, state, wait_event_type, wait_event, xact_start IS NOT NULL AS in_xact"
         " FROM pg_stat_activity WHERE pid = %s")


def insert_big(db, aggregates, versions, size):
    """aggregates x versions rows with payloads of `size` bytes, built in the
    server (nothing large crosses from the test)."""
    db.execute("INSERT INTO %s (aggregate_type, aggregate_id, aggregate_version, event_type,"
               " payload_json) SELECT 'Order', 'big' || a, v, 'Changed',"
               " jsonb_build_object('a', a, 'v', v, 'pad', repeat(md5(a::text || v::text), %%s))"
               " FROM generate_series(1, %%s) v, generate_series(0, %%s - 1) a"
               % db.table, (size // 32, versions, aggregates))
    return aggregates * versions


class Frozen:
    """Relay A (frozen by the test), relay B, the sweeper; stops them all."""

    def __init__(self, db, kafka, tmp_path, **a_settings):
        self.db, self.kafka, self.tmp_path = db, kafka, tmp_path
        self.a = Relay("outbox-relay", name="A", log_dir=tmp_path,
                       env=relay_env(db, kafka, "A", **{**RELAY_SETTINGS, **a_settings}))
        self.b = self.sweeper = None
        self.frozen_at = None

    def freeze(self):
        self.a.send_signal(signal.SIGSTOP)
        self.frozen_at = time.monotonic()

    def start_others(self):
        self.b = Relay("outbox-relay", name="B", log_dir=self.tmp_path,
                       env=relay_env(self.db, self.kafka, "B", **RELAY_SETTINGS))
        self.sweeper = Relay("outbox-sweeper", name="sweeper", log_dir=self.tmp_path,
                             env=sweeper_env(self.db, "sweeper",
                                             OUTBOX_LOCK_TIMEOUT_S=LOCK_TIMEOUT_S,
                                             OUTBOX_SWEEP_INTERVAL_S=SWEEP_INTERVAL_S))

    def wait_all_published(self, total):
        """Seconds from the freeze until every row is PUBLISHED; fails past
        HOLD_BOUND_S with what is left and who holds it."""
        def done():
            return self.db.count("status = 'PUBLISHED'") == total
        try:
            wait_until(done, HOLD_BOUND_S - (time.monotonic() - self.frozen_at), interval=0.1,
                       what="every row PUBLISHED within %.0f s of freezing A" % HOLD_BOUND_S)
        except AssertionError as e:
            left = self.db.execute("SELECT status, locked_by, count(*) AS n FROM %s WHERE"
                                   " status <> 'PUBLISHED' GROUP BY 1, 2" % self.db.table)
            locked = self.db.execute("SELECT count(*) AS n FROM pg_locks l JOIN pg_class c ON"
                                     " c.oid = l.relation WHERE c.relname = 'outbox_event'"
                                     " AND l.mode = 'RowExclusiveLock'")
            raise AssertionError("%s; left: %s; RowExclusiveLock holders: %s"
                                 % (e, left, locked[0]["n"])) from None
        return time.monotonic() - self.frozen_at

    def thaw_and_stop(self):
        """SIGCONT A, let it run AFTER_CONTINUE_S (it may produce what it
        held), then stop it; returns its exit code."""
        self.a.send_signal(signal.SIGCONT)
        time.sleep(AFTER_CONTINUE_S)  # the thawed relay's own time to act is what is tested
        try:
            return self.a.stop(timeout=40)
        except AssertionError:
            return None

    def stop_all(self):
        if self.a.running():
            self.a.send_signal(signal.SIGCONT)
            self.a.kill()
        for p in (self.b, self.sweeper):
            if p is not None and p.running():
                p.stop()

    def check(self, report, point, took, a_rc, extra=""):
        db = self.db
        table = db.rows()
        assert all(r["status"] == "PUBLISHED" for r in table), db.status_counts()
        audit = check_audit(db, lock_timeout_s=LOCK_TIMEOUT_S)
        assert not audit.violations, audit.violations[:10]
        topic = "%s.Order" % db.schema
        kc, problems = check_kafka(self.kafka, [topic], table,
                                   dup_allowed=audit.relocked_after_stale)
        dups = sorted(kc.dups.items())
        if dups:
            print("\n%d events on Kafka more than once (event id: copies), e.g. %s"
                  % (len(dups), dups[:10]))
        assert not problems, problems
        assert len(kc.ids) == len(table)
        report("%s: A frozen, every row PUBLISHED %.1f s later (bound %.0f s = lock timeout %d"
               " + statement timeout %.0f + sweep %d + drain %d); sweeper reset %d locks; A"
               " thawed and stopped (exit %s); kafka: %d messages, %d duplicate copies of %d"
               " events (all re-locked after STALE_LOCK); order ok%s",
               point, took, HOLD_BOUND_S, LOCK_TIMEOUT_S, STATEMENT_TIMEOUT_MS / 1000,
               SWEEP_INTERVAL_S, DRAIN_S, sum(audit.stale_resets.values()), a_rc,
               len(kc.msgs), kc.extra_copies, len(kc.dups), extra)


@NEW_CORE
def test_frozen_mid_lock_statement(db, kafka, tmp_path, report):
    kafka.create_topic("%s.Order" % db.schema, 4)
    # 40 aggregates x 10 versions of 50 KB: one lock statement's result is
    # megabytes, more than the loopback socket buffers hold
    total = insert_big(db, aggregates=40, versions=10, size=50000)
    f = Frozen(db, kafka, tmp_path, OUTBOX_TEST_LOCK_DELAY_MS=LOCK_DELAY_MS)
    try:
        (pid, _), = [(r["pid"], r["query"]) for r in wait_until(
            lambda: db.execute(SLEEPING, ("%%%s%%" % db.schema,)), 30,
            what="A's first lock statement pausing before its row locks")]
        f.freeze()
        # The server goes on: the pause ends, the statement locks the rows,
        # sends its answer to a client that does not read and must end its
        # transaction all the same.
        wait_until(lambda: not any(s["in_xact"] for s in db.execute(STATE, (pid,))),
                   (LOCK_DELAY_MS + STATEMENT_TIMEOUT_MS) / 1000, interval=0.05,
                   what="the transaction of frozen A's lock statement over (committed or"
                        " cut off)")
        state = db.execute(STATE, (pid,))
        held = db.count("status = 'PUBLISHING' AND locked_by = 'A'")
        assert held > 0, "A's lock statement locked nothing: nothing tests the sweeper"
        f.start_others()
        took = f.wait_all_published(total)
        a_rc = f.thaw_and_stop()
        f.stop_all()
        f.check(report, "mid lock statement", took, a_rc,
                "; A held %d rows PUBLISHING; A's lock backend once its transaction ended: %s"
                % (held, state[0] if state else "gone"))
    finally:
        f.stop_all()


def test_frozen_mid_produce(db, kafka, tmp_path, report):
    kafka.create_topic("%s.Order" % db.schema, 4)
    rows = make_events(aggregates=100, versions=40)
    db.insert_events(rows)
    f = Frozen(db, kafka, tmp_path, OUTBOX_BATCH_SIZE=200)
    try:
        wait_until(lambda: db.count("status = 'PUBLISHED'") >= 400, 60,
                   what="A publishing")
        with kafka.paused():
            # A's next produce requests are sent to a broker that does not
            # answer: A holds its batch, delivery reports owed.
            wait_until(lambda: db.count("status = 'PUBLISHING' AND locked_by = 'A'") > 0, 10,
                       interval=0.02, what="A holding rows with the broker stopped")
            time.sleep(0.3)  # the produce requests are on the wire by now
            held = db.count("status = 'PUBLISHING' AND locked_by = 'A'")
            f.freeze()
        f.start_others()
        took = f.wait_all_published(len(rows))
        a_rc = f.thaw_and_stop()
        f.stop_all()
        f.check(report, "mid produce", took, a_rc, "; A held %d rows PUBLISHING" % held)
    finally:
        f.stop_all()


@NEW_CORE
def test_frozen_mid_mark(db, kafka, tmp_path, report):
    kafka.create_topic("%s.Order" % db.schema, 4)
    rows = make_events(aggregates=100, versions=20)
    db.insert_events(rows)
    f = Frozen(db, kafka, tmp_path, OUTBOX_BATCH_SIZE=200, OUTBOX_TEST_MARK_DELAY_MS=1500)
    try:
        wait_until(lambda: db.execute(SLEEPING, ("%%%s%%" % db.schema,)), 30,
                   what="A's mark statement pausing before it changes rows "
                        "(OUTBOX_TEST_MARK_DELAY_MS)")
        held = db.count("status = 'PUBLISHING' AND locked_by = 'A'")
        f.freeze()
        f.start_others()
        took = f.wait_all_published(len(rows))
        a_rc = f.thaw_and_stop()
        f.stop_all()
        f.check(report, "mid mark", took, a_rc, "; A held %d rows PUBLISHING" % held)
    finally:
        f.stop_all()


@pytest.fixture(autouse=True)
def _never_leave_a_stopped_process():
    """A test that fails between SIGSTOP and SIGCONT must not leave a stopped
    relay behind (the module fixture SIGKILLs leftovers, which a stopped
    process receives too; this only makes it immediate)."""
    yield
    for r in Relay.started:
        if r.running():
            r.send_signal(signal.SIGCONT)
