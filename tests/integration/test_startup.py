"""Start-up: the first event goes out in milliseconds. The idempotent
producer connects and gets its producer id when the relay starts, and the
first message to a topic fetches that topic's metadata at once instead of on
librdkafka's next one-second refresh."""
import datetime
import re

from conftest import relay_env
from harness import Relay, make_events, wait_until

# Without the fetch the first ack comes after librdkafka's 1 s timer scan;
# with it, within about 0.1 s on this machine. The bound leaves room for a
# loaded test machine and still tells the two apart.
FIRST_ACK_S = 0.7


def log_ts(line):
    m = re.search(r"ts=(\S+)Z", line)
    return datetime.datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S.%f").replace(
        tzinfo=datetime.timezone.utc)


def test_first_event_goes_out_in_milliseconds(db, kafka, tmp_path):
    topic = "%s.Order" % db.schema
    kafka.create_topic(topic, 4)  # production topics exist before the relay runs
    db.insert_events(make_events(aggregates=1))
    env = relay_env(db, kafka, OUTBOX_LOG_LEVEL="debug", OUTBOX_KAFKA_DEBUG="eos")
    with Relay("outbox-relay", env=env, log_dir=tmp_path) as relay:
        started = relay.wait_log(r'.*msg="starting".*', 20)
        wait_until(lambda: db.status_counts()["PUBLISHED"] == 1, 20, what="row PUBLISHED")
        assert relay.stop() == 0
    (row,) = db.rows()
    took = (row["published_at"] - log_ts(started.group(0))).total_seconds()
    assert took < FIRST_ACK_S, "first ack %.3f s after start" % took
    # one producer id for the whole run, acquired before the first batch
    log = relay.log_text()
    assert len(re.findall(r"Acquired PID", log)) == 1
    assert log.index("Acquired PID") < log.index('msg="batch done"')
