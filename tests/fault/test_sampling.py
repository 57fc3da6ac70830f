"""The gauges' table sample (outbox_events, outbox_oldest_pending_age_seconds)
counts every unpublished row, so it slows down as the backlog grows, and the
relay's loop waits for it. A relay keeps it to about 2 % of its time: after a
sample that took s seconds, the next comes no sooner than 50 s later (10 s
when it is fast). The test hook OUTBOX_TEST_SAMPLE_DELAY_MS (compiled in only
with -DOUTBOX_TEST_HOOKS=ON, as tests/run builds the binaries it tests) makes
every sample as slow as a large backlog would.

Broker: Apache Kafka (tests/run's)."""
import re

from conftest import relay_env, wait_quiet
from harness import Relay, make_events

SAMPLED = r'msg="table sampled" seconds=([0-9.]+) next_in_s=([0-9.]+)'


def test_a_slow_table_sample_is_taken_less_often(db, kafka, tmp_path):
    kafka.create_topic("%s.Order" % db.schema, 4)
    rows = make_events(aggregates=3, versions=2, id_prefix="sample")
    db.insert_events(rows)
    slow_env = relay_env(db, kafka, "r-slow", OUTBOX_LOG_LEVEL="debug",
                         OUTBOX_TEST_SAMPLE_DELAY_MS=400)
    fast_env = relay_env(db, kafka, "r-fast", OUTBOX_LOG_LEVEL="debug")
    with Relay("outbox-relay", name="r-slow", log_dir=tmp_path, env=slow_env) as slow, \
            Relay("outbox-relay", name="r-fast", log_dir=tmp_path, env=fast_env) as fast:
        m = slow.wait_log(SAMPLED, 30)
        took, next_in = float(m.group(1)), float(m.group(2))
        assert took >= 0.4, m.group(0)
        assert next_in >= 50 * took - 0.1, m.group(0)  # 20 s and more, not 10
        slow_line = r'msg="table sample slow, sampling less often" seconds=[0-9.]+ next_in_s=%s'
        assert re.search(slow_line % re.escape(m.group(2)), slow.log_text()), \
            slow.log_text()[-2000:]

        m = fast.wait_log(SAMPLED, 30)
        assert float(m.group(2)) == 10.0, m.group(0)
        assert "table sample slow" not in fast.log_text()

        # a slow sample delays the gauges, not the rows
        counts = wait_quiet(db, 60, "every row PUBLISHED")
        assert counts["PUBLISHED"] == len(rows), counts
        assert slow.stop() == 0 and fast.stop() == 0
