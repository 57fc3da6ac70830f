"""pytest fixtures shared by the integration and fault suites: one PostgreSQL
server per session (tests/run's, or a private one) and one local
Kafka-protocol broker per module. A conftest imports them by name."""
import pytest

from harness import MockBroker, Postgres, Relay


@pytest.fixture(scope="session")
def pg():
    p = Postgres()
    yield p
    p.close()


@pytest.fixture(scope="module")
def kafka(tmp_path_factory):
    with MockBroker(log_dir=str(tmp_path_factory.mktemp("broker"))) as b:
        yield b


@pytest.fixture(scope="module", autouse=True)
def no_leftover_processes():
    """A test that fails half-way may leave relays running: kill them at the end
    of the module (module-scoped scenarios share processes across tests), so they
    do not keep working, and using CPU, through the modules after it."""
    yield
    Relay.kill_leftovers()
