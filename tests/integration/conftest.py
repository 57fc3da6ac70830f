"""Shared fixtures for integration tests: one PostgreSQL server (tests/run's,
or a private one), Apache Kafka (tests/run's broker, or a private one; the mock
cluster as mock_kafka where a test needs brokers down on command); a private
schema and topic prefix per test."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "support"))

from fixtures import kafka, mock_kafka, no_leftover_processes, pg  # noqa: E402,F401  (used by name)
from harness import TestSchema  # noqa: E402
from observe import register_markers, report  # noqa: E402,F401  (report by name)


def pytest_configure(config):
    register_markers(config)


@pytest.fixture
def db(pg, request):
    with TestSchema(pg, request.node.name[:20]) as s:
        yield s


def relay_env(db, kafka, **extra):
    """Environment for a relay on the test's table with its own topic prefix."""
    env = {**db.env(),
           "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": kafka.bootstrap,
           "OUTBOX_HTTP_ADDR": "off",
           "OUTBOX_LOG_FORMAT": "text",
           "OUTBOX_POLL_INTERVAL_MS": "100",
           "OUTBOX_TOPIC_TEMPLATE": "%s.{aggregate_type}" % db.schema}
    env.update({k: str(v) for k, v in extra.items()})
    return env
