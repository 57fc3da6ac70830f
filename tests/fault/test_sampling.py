"""The gauges' table sample (outbox_events, outbox_oldest_pending_age_seconds)
counts every unpublished row, so it slows down as the backlog grows; it runs
on the relay's side connection, and the server pays for it. A relay keeps it
to about 2 % of the time: after a sampling chain that took s seconds, the
next sample starts no sooner than 50 s after the last one started (10 s when
it is fast), and the relay logs `table sample slow, sampling less often`
when this starts (docs/DESIGN.md, "Observability"). The test hook
OUTBOX_TEST_SAMPLE_DELAY_MS (compiled in only with -DOUTBOX_TEST_HOOKS=ON, as
tests/run builds the binaries it tests) makes every sample as slow as a large
backlog would.

The samples are seen on the server: the sample statement of each relay's
side connection, active in pg_stat_activity, one query_start per run.

Broker: Apache Kafka (tests/run's)."""
import threading
import time

from conftest import relay_env, wait_quiet
from harness import Relay, make_events, wait_until

SLOW_LINE = r'msg="table sample slow, sampling less often" seconds=([0-9.]+) next_in_s=([0-9.]+)'
SLOW_MS = 400
# Long enough to be seen by a poll every 20 ms, short enough that the chain
# stays fast (50 x s < 10 s).
FAST_MS = 60


class SampleStarts(threading.Thread):
    """Polls pg_stat_activity for the sample statement (the only relay
    statement that reads n_live_tup) running on a relay's side connection;
    keeps each run's query_start per relay id."""

    def __init__(self, pg, relay_ids, schema):
        super().__init__(daemon=True)
        self.pg = pg
        self.schema = schema  # other modules' relays share ids (r-slow) on this server
        self.starts = {rid: set() for rid in relay_ids}
        self.stopped = threading.Event()
        self.error = None

    def run(self):
        conn = self.pg.connect()
        try:
            while not self.stopped.is_set():
                with conn.cursor() as cur:
                    cur.execute("SELECT application_name, extract(epoch FROM query_start)::float8"
                                " FROM pg_stat_activity WHERE application_name LIKE"
                                " 'outbox-relay:side:%%' AND state = 'active'"
                                " AND query LIKE '%%n_live_tup%%' AND query LIKE %s",
                                ("%%%s%%" % self.schema,))
                    for app, start in cur.fetchall():
                        rid = app.split(":", 2)[2]
                        if rid in self.starts:
                            self.starts[rid].add(start)
                time.sleep(0.02)
        except Exception as e:  # reported by stop()
            self.error = e
        finally:
            conn.close()

    def first(self, rid, n):
        """The first n sample starts of relay rid (epoch seconds), or None.
        Starts less than 1 s apart are one sample: a statement's query_start
        can move between its Bind and its Execute (extended protocol), and a
        loaded machine lets the poller see both."""
        s = []
        for t in sorted(self.starts[rid]):
            if not s or t - s[-1] >= 1.0:
                s.append(t)
        return s[:n] if len(s) >= n else None

    def stop(self):
        self.stopped.set()
        self.join(10)
        assert self.error is None, self.error


def test_a_slow_table_sample_is_taken_less_often(db, kafka, tmp_path, report):
    kafka.create_topic("%s.Order" % db.schema, 4)
    rows = make_events(aggregates=3, versions=2, id_prefix="sample")
    db.insert_events(rows)
    slow_env = relay_env(db, kafka, "r-slow", OUTBOX_TEST_SAMPLE_DELAY_MS=SLOW_MS)
    fast_env = relay_env(db, kafka, "r-fast", OUTBOX_TEST_SAMPLE_DELAY_MS=FAST_MS)
    seen = SampleStarts(db.pg, ["r-slow", "r-fast"], db.schema)
    seen.start()
    try:
        with Relay("outbox-relay", name="r-slow", log_dir=tmp_path, env=slow_env) as slow, \
                Relay("outbox-relay", name="r-fast", log_dir=tmp_path, env=fast_env) as fast:
            m = slow.wait_log(SLOW_LINE, 30)
            took, next_in = float(m.group(1)), float(m.group(2))
            assert took >= SLOW_MS / 1000, m.group(0)
            # next_in_s counts from the end of the chain, which took `took`
            assert next_in >= 49 * took - 0.1, m.group(0)  # 20 s and more, not 10

            # three: a 60 ms sample the 20 ms poller misses on a loaded machine
            # makes one 20 s gap, never two
            fast_starts = wait_until(lambda: seen.first("r-fast", 3), 40,
                                     what="three samples of the fast relay")
            slow_starts = wait_until(lambda: seen.first("r-slow", 2), 50 * took + 20,
                                     what="two samples of the slow relay")
            assert "table sample slow" not in fast.log_text(), fast.log_text()[-2000:]

            # a slow sample delays the gauges, not the rows
            counts = wait_quiet(db, 60, "every row PUBLISHED")
            assert counts["PUBLISHED"] == len(rows), counts
            assert slow.stop() == 0 and fast.stop() == 0
    finally:
        seen.stop()
    slow_gap = slow_starts[1] - slow_starts[0]
    fast_gap = min(b - a for a, b in zip(fast_starts, fast_starts[1:]))
    assert 50 * took - 0.2 <= slow_gap <= 50 * took + 3, (slow_gap, took)
    assert 9.8 <= fast_gap <= 12, fast_gap
    report("a sample chain of %.3f s: the next sample %.1f s after it started (logged"
           " next_in_s=%.1f); a fast relay's samples %.1f s apart", took, slow_gap, next_in,
           fast_gap)


def test_a_very_slow_sample_waits_two_minutes_at_most(db, kafka, tmp_path, report):
    # 50 x 3 s would be 150 s: a sample slowed by a passing overload must not
    # leave the gauges stale for longer than 120 s after it
    kafka.create_topic("%s.Order" % db.schema, 4)
    env = relay_env(db, kafka, "r-slowest", OUTBOX_TEST_SAMPLE_DELAY_MS=3000)
    with Relay("outbox-relay", name="r-slowest", log_dir=tmp_path, env=env) as relay:
        m = relay.wait_log(SLOW_LINE, 40)
        took, next_in = float(m.group(1)), float(m.group(2))
        assert took >= 3.0, m.group(0)
        assert 119.5 <= next_in <= 120.5, m.group(0)
        assert relay.stop() == 0
    report("a sample chain of %.1f s: the next in %.1f s, not %.0f", took, next_in, 50 * took)
