"""The relay against Apache Kafka secured as production runs it: a SASL_SSL
listener (TLS from a CA the launcher makes for the test, SASL users for
SCRAM-SHA-512 and PLAIN), configured only through the OUTBOX_KAFKA_* variables
docs/operations.md documents under "Against a real Kafka cluster" (the same names the
Helm chart renders: tests/helm/run checks that side).

Brokers: one Apache Kafka node of this module's own for each supported line
(deploy/local/kafka start --sasl; Kafka 4, the default, and Kafka 3);
messages are read back over the SASL_SSL listener (kafka-python,
SCRAM-SHA-512). SCRAM-SHA-512 against Kafka 4 needs librdkafka 2.6.1 or later
(older ones send a client-final nonce Kafka 4 rejects); the build requires
2.8 (deploy/versions).
"""
import os
import re
import time

import pytest

from conftest import relay_env
from harness import (KafkaCluster, Relay, free_port, header, http_status, make_events,
                     read_topics, wait_until)

# kafka-python's TLS set-up uses a constant Python 3.10 deprecated.
pytestmark = pytest.mark.filterwarnings("ignore:ssl.PROTOCOL_TLS:DeprecationWarning")

CLK_TCK = os.sysconf("SC_CLK_TCK")
GUIDE = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "operations.md")


def guide_kafka_variables():
    """The OUTBOX_KAFKA_* names docs/operations.md's SASL_SSL example exports."""
    with open(GUIDE, encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Against a real Kafka cluster", 1)[1].split("\n## ", 1)[0]
    block = section.split("```sh", 1)[1].split("```", 1)[0]
    return set(re.findall(r"^export (OUTBOX_KAFKA_[A-Z_]+)=", block, re.M))


@pytest.fixture(scope="module")
def secured():
    with KafkaCluster(sasl=True) as k:
        yield k


@pytest.fixture(scope="module")
def secured_kafka3():
    """Kafka 3 (deploy/versions' KAFKA_3) with the same SASL_SSL listener."""
    with KafkaCluster(sasl=True, version="3") as k:
        yield k


def sasl_env(db, broker, mechanism, password, **extra):
    """A relay on the test's table, its Kafka settings exactly docs/operations.md's."""
    kafka = {"OUTBOX_KAFKA_BOOTSTRAP_SERVERS": broker.sasl_bootstrap,
             "OUTBOX_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
             "OUTBOX_KAFKA_SASL_MECHANISMS": mechanism,
             "OUTBOX_KAFKA_SASL_USERNAME": broker.sasl_user,
             "OUTBOX_KAFKA_SASL_PASSWORD": password,
             "OUTBOX_KAFKA_SSL_CA_LOCATION": broker.ca_path}
    assert set(kafka) == guide_kafka_variables(), "docs/operations.md's SASL_SSL example changed"
    env = relay_env(db, broker, **kafka, **extra)
    return env


def readback(broker, topic):
    return read_topics(broker.sasl_bootstrap, topics=[topic], security={
        "security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": broker.sasl_user, "sasl_plain_password": broker.sasl_password,
        "ssl_cafile": broker.ca_path})


readyz = http_status  # the endpoint these tests watch is /readyz


def kafka_version(broker):
    with open(os.path.join(broker.dir, "version")) as f:
        return f.read().strip()


def cpu_seconds(pid):
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def publishes(db, broker, tmp_path, mechanism):
    """The relay publishes over SASL_SSL with `mechanism`; the messages are
    read back over SASL_SSL. Returns how many."""
    topic = "%s.Order" % db.schema
    broker.create_topic(topic, 2)
    rows = make_events(aggregates=5, versions=4)
    db.insert_events(rows)
    port = free_port()
    env = sasl_env(db, broker, mechanism, broker.sasl_password,
                   OUTBOX_HTTP_ADDR="127.0.0.1:%d" % port)
    with Relay("outbox-relay", name="r-%s" % mechanism.lower(), log_dir=tmp_path,
               env=env) as relay:
        wait_until(lambda: db.count("status = 'PUBLISHED'") == len(rows), 60,
                   what="rows PUBLISHED over SASL_SSL (%s)" % mechanism)
        assert readyz(port) == 200
        assert relay.stop() == 0
        log = relay.log_text()
    assert broker.sasl_password not in log
    msgs = readback(broker, topic)
    assert sorted(header(m, "event-id") for m in msgs) == \
        sorted(r["outbox_id"] for r in db.rows())
    return len(msgs)


def refused(db, broker, tmp_path, report, mechanism, password, what):
    """The relay cannot authenticate: not ready, one clear log line per
    failure, no busy loop, no secret in the log; its rows wait as FAILED."""
    topic = "%s.Order" % db.schema
    broker.create_topic(topic, 2)
    db.insert_events(make_events(aggregates=5, versions=2))
    port = free_port()
    env = sasl_env(db, broker, mechanism, password, OUTBOX_HTTP_ADDR="127.0.0.1:%d" % port,
                   OUTBOX_KAFKA_DELIVERY_TIMEOUT_MS=3000, OUTBOX_BACKOFF_INITIAL_MS=500,
                   OUTBOX_BACKOFF_MAX_MS=2000)
    with Relay("outbox-relay", name="r-refused", log_dir=tmp_path, env=env) as relay:
        line = relay.wait_log(r'.*err=_AUTHENTICATION .*', 30).group(0)
        wait_until(lambda: db.count("status = 'FAILED'"), 30, what="rows FAILED")
        # Over the next seconds: timeouts, backoffs and reconnects, no spinning.
        cpu0, t0, lines0 = cpu_seconds(relay.pid), time.monotonic(), len(relay.log_text())
        codes = set()
        while time.monotonic() - t0 < 6:
            codes.add(readyz(port))
            time.sleep(0.25)
        cpu_share = (cpu_seconds(relay.pid) - cpu0) / (time.monotonic() - t0)
        logged = relay.log_text()[lines0:].count("\n")
        assert relay.running()
        assert relay.stop() == 0
        log = relay.log_text()
    assert codes == {503}, codes
    # PLAIN: "Invalid username or password"; SCRAM: "... invalid credentials ..."
    assert re.search(r"(?i)invalid (credentials|username or password)", line), line
    assert cpu_share < 0.10, "relay used %.0f%% CPU unable to authenticate" % (cpu_share * 100)
    assert logged < 60, "%d log lines in 6 s" % logged
    for secret in (password, broker.sasl_password, "outbox-secret"):
        assert secret not in log, "a secret in the log"
    assert db.count("status = 'PUBLISHED'") == 0 and db.count("status = 'DEAD'") == 0
    failed = db.rows(where="status = 'FAILED'")
    assert all(r["available_at"] > r["updated_at"] for r in failed)
    report("%s: /readyz %s throughout, relay CPU %.1f%%, %d log lines in 6 s, rows FAILED "
           "with %s and backed off, no secret in the log; the line: %s", what, sorted(codes),
           cpu_share * 100, logged, sorted({r["last_error_code"] for r in failed}),
           line[:300])


@pytest.fixture
def report(request, capsys):
    def out(fmt, *args):
        with capsys.disabled():
            print("\n[%s] %s" % (request.node.name, fmt % args))
    return out


def test_sasl_ssl_plain_publishes(db, secured, tmp_path, report):
    n = publishes(db, secured, tmp_path, "PLAIN")
    report("SASL_SSL + PLAIN, TLS from the test's CA, only docs/operations.md's variables: %d messages "
           "published and read back over SASL_SSL", n)


def test_sasl_ssl_scram_sha_512(db, secured, tmp_path, report):
    n = publishes(db, secured, tmp_path, "SCRAM-SHA-512")
    report("SASL_SSL + SCRAM-SHA-512 against Apache Kafka %s, only docs/operations.md's variables: "
           "%d messages published and read back", kafka_version(secured), n)


def test_sasl_ssl_scram_sha_512_on_kafka_3(db, secured_kafka3, tmp_path, report):
    n = publishes(db, secured_kafka3, tmp_path, "SCRAM-SHA-512")
    report("SASL_SSL + SCRAM-SHA-512 against Apache Kafka %s, only docs/operations.md's variables: "
           "%d messages published and read back", kafka_version(secured_kafka3), n)


def test_scram_wrong_password_not_ready(db, secured_kafka3, tmp_path, report):
    refused(db, secured_kafka3, tmp_path, report, "SCRAM-SHA-512",
            "wrong-" + secured_kafka3.sasl_password[:8],
            "SCRAM-SHA-512 on Kafka %s, wrong password" % kafka_version(secured_kafka3))


def test_wrong_password_not_ready_no_busy_loop_no_secret(db, secured, tmp_path, report):
    refused(db, secured, tmp_path, report, "PLAIN", "wrong-" + secured.sasl_password[:8],
            "PLAIN, wrong password")
