"""pytest fixtures shared by the integration and fault suites: one PostgreSQL
server per session (tests/run's, or a private one), Apache Kafka (`kafka`:
tests/run's single-node broker, or a private one) and librdkafka's mock cluster
(`mock_kafka`, one per module, for injected errors and brokers down on
command). A conftest imports them by name."""
import pytest

from harness import KafkaCluster, MockBroker, Postgres, Relay


@pytest.fixture(scope="session")
def pg():
    p = Postgres()
    yield p
    p.close()


@pytest.fixture(scope="module", name="pg")
def own_pg():
    """A server of the module's own, in place of the session's `pg` for a
    module that imports this: its tests restart it, stop it and end its
    sessions, which no module running beside them may see."""
    with Postgres(own=True) as server:
        yield server


@pytest.fixture(scope="module")
def kafka():
    """Apache Kafka, one node: topics are created on first use (4 partitions)
    or by create_topic()."""
    k = KafkaCluster.shared()
    yield k
    k.stop()


@pytest.fixture(scope="module")
def mock_kafka(tmp_path_factory):
    with MockBroker(log_dir=str(tmp_path_factory.mktemp("broker"))) as b:
        yield b


@pytest.fixture(scope="module", autouse=True)
def no_leftover_processes():
    """A test that fails half-way may leave relays running: kill them at the end
    of the module (module-scoped scenarios share processes across tests), so they
    do not keep working, and using CPU, through the modules after it."""
    yield
    Relay.kill_leftovers()
