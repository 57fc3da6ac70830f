"""Configuration that is well-formed but cannot work is refused at start
(docs/DESIGN.md, "Configuration"): exit 2, one line naming the variable,
before the database or Kafka is touched.

  - OUTBOX_TOPIC_TEMPLATE: a character Kafka refuses in a topic name (a space,
    a slash), or literal parts longer than Kafka's 249 characters leave room for;
  - OUTBOX_RELAY_ID: a control character (a newline would split the relay's log
    lines and goes into locked_by), or longer than 200 bytes (100 KB here);
  - OUTBOX_PRODUCER_NAME: a control character (it is a header of every message);
  - OUTBOX_RETENTION_S (sweeper): so long that `now() - retention` is before
    PostgreSQL's first timestamp (every sweep would fail)."""
import pytest

from harness import Relay

BASE = {"OUTBOX_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none",
        "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1", "OUTBOX_HTTP_ADDR": "off",
        "OUTBOX_LOG_FORMAT": "text"}

CASES = [
    ("outbox-relay", "OUTBOX_TOPIC_TEMPLATE", "outbox event.{aggregate_type}"),
    ("outbox-relay", "OUTBOX_TOPIC_TEMPLATE", "outbox/{aggregate_type}"),
    ("outbox-relay", "OUTBOX_TOPIC_TEMPLATE", "t" * 250),
    ("outbox-relay", "OUTBOX_TOPIC_TEMPLATE", "t" * 247 + ".{aggregate_type}.{event_type}"),
    ("outbox-relay", "OUTBOX_RELAY_ID", "relay-1\nlevel=error msg=forged"),
    ("outbox-relay", "OUTBOX_RELAY_ID", "r" * 100 * 1024),
    ("outbox-relay", "OUTBOX_PRODUCER_NAME", "svc\r\n"),
    ("outbox-sweeper", "OUTBOX_RELAY_ID", "sweeper\t1"),
    ("outbox-sweeper", "OUTBOX_RETENTION_S", "9000000000000"),
]


@pytest.mark.parametrize("program,var,value", CASES,
                         ids=["%s-%s-%d" % (p.split("-")[1], v[7:].lower(), i)
                              for i, (p, v, _) in enumerate(CASES)])
def test_setting_that_cannot_work_exits_2_naming_it(tmp_path, program, var, value):
    r = Relay(program, env={**BASE, var: value}, log_dir=tmp_path, name="bad")
    code = r.wait(20)
    log = r.log_text()
    lines = log.splitlines()
    assert code == 2, (code, log[-2000:])
    assert len(lines) == 1, lines[:5]
    assert "bad configuration" in lines[0] and var in lines[0], lines[0]
    assert len(lines[0]) < 2000, "the line quotes the whole value: %d bytes" % len(lines[0])
