"""Configuration that would break a guarantee is refused at start: exit 2 with
one line naming the setting, in the configured log format, before the
database is touched."""
import json

from conftest import relay_env
from harness import Relay


def run_bad(env, tmp_path, args=(), name="bad"):
    r = Relay("outbox-relay", env=env, args=args, log_dir=tmp_path, name=name)
    code = r.wait(20)
    return code, r.log_text()


def test_producer_settings_that_break_guarantees_exit_2_naming_them(db, kafka, tmp_path):
    base = relay_env(db, kafka)
    cases = [
        ({"OUTBOX_KAFKA_ACKS": "1"}, (), "OUTBOX_KAFKA_ACKS"),
        ({}, ("-X", "acks=0"), "-X acks"),
        ({"OUTBOX_KAFKA_REQUEST_REQUIRED_ACKS": "1"}, (), "OUTBOX_KAFKA_REQUEST_REQUIRED_ACKS"),
        ({"OUTBOX_KAFKA_MAX_IN_FLIGHT_REQUESTS_PER_CONNECTION": "10"}, (),
         "OUTBOX_KAFKA_MAX_IN_FLIGHT_REQUESTS_PER_CONNECTION"),
        ({"OUTBOX_KAFKA_RETRIES": "0"}, (), "OUTBOX_KAFKA_RETRIES"),
        ({"OUTBOX_KAFKA_QUEUING_STRATEGY": "lifo"}, (), "OUTBOX_KAFKA_QUEUING_STRATEGY"),
        ({"OUTBOX_KAFKA_TRANSACTIONAL_ID": "t1"}, (), "OUTBOX_KAFKA_TRANSACTIONAL_ID"),
        ({"OUTBOX_KAFKA_PARTITIONER": "random"}, (), "OUTBOX_KAFKA_PARTITIONER"),
        # the sweeper would take back locks of batches still being delivered
        ({"OUTBOX_KAFKA_DELIVERY_TIMEOUT_MS": "300000"}, (), "OUTBOX_KAFKA_DELIVERY_TIMEOUT_MS"),
        ({"OUTBOX_KAFKA_MESSAGE_TIMEOUT_MS": "120000", "OUTBOX_LOCK_TIMEOUT_S": "60"}, (),
         "OUTBOX_KAFKA_MESSAGE_TIMEOUT_MS"),
        ({"OUTBOX_LOCK_TIMEOUT_S": "100"}, (), "OUTBOX_LOCK_TIMEOUT_S"),
    ]
    for i, (extra, args, name) in enumerate(cases):
        code, log = run_bad({**base, **extra}, tmp_path, args, name="bad%d" % i)
        lines = [ln for ln in log.splitlines() if "level=" in ln]
        assert code == 2, (extra, args, code, log)
        assert len(lines) == 1 and "bad configuration" in lines[0], log
        assert name in lines[0], (name, lines[0])
        assert "cannot start" not in log
    # a delivery timeout that leaves the margin is accepted (the relay starts)
    ok = Relay("outbox-relay", env={**base, "OUTBOX_KAFKA_DELIVERY_TIMEOUT_MS": "60000",
                                    "OUTBOX_LOCK_TIMEOUT_S": "90"},
               log_dir=tmp_path, name="ok")
    ok.wait_log(r'msg="started"', 20)
    assert ok.stop() == 0
    assert db.status_counts() == {s: 0 for s in db.status_counts()}


def test_config_errors_use_the_configured_log_format(db, kafka, tmp_path):
    base = relay_env(db, kafka, OUTBOX_LOG_FORMAT="json")
    cfg_dir = tmp_path / "conf.d"
    cfg_dir.mkdir()
    code, log = run_bad(base, tmp_path, ("--config", str(cfg_dir)), name="dir")
    assert code == 2
    (line,) = log.splitlines()
    entry = json.loads(line)
    assert entry["level"] == "error" and "is a directory" in entry["err"], entry
    # an unknown flag, with the format asked for on the command line
    code, log = run_bad({**base, "OUTBOX_LOG_FORMAT": "text"}, tmp_path,
                        ("--log-format", "json", "--no-such-flag", "1"), name="flag")
    assert code == 2
    entry = json.loads(log.splitlines()[0])
    assert "--no-such-flag" in entry["err"]
    # an error inside the file, with the format the file asks for
    f = tmp_path / "relay.conf"
    f.write_text("log_format = json\nbatch_size = many\n")
    env = {k: v for k, v in base.items() if k != "OUTBOX_LOG_FORMAT"}
    code, log = run_bad(env, tmp_path, ("--config", str(f)), name="file")
    assert code == 2
    entry = json.loads(log.splitlines()[0])
    assert "OUTBOX_BATCH_SIZE" in entry["err"], entry
