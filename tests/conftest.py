"""Shared fixtures. Servers are started by the test command (scripts/test.sh);
here a missing server is a failure with a clear message, never a skip."""

from __future__ import annotations

import signal
import uuid
from collections.abc import Iterator

import pytest

from infra.cql import migrate
from infra.process import port_open
from tandoor.clients import cassandra_session
from tandoor.settings import Settings
from tests.seeds import seed_note


def pytest_report_header() -> str:
    return seed_note()


def pytest_configure(config: pytest.Config) -> None:
    # scripts/test.sh passes a TERM or INT on as TERM: taken as Ctrl-C, so fixtures stop
    # the workers and gateways they started (killed outright, those ran on).
    signal.signal(signal.SIGTERM, _interrupted)


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@pytest.fixture(scope="session")
def settings() -> Settings:
    return Settings()


@pytest.fixture
def unique() -> str:
    """A fresh suffix for topic, group and keyspace names: tests share nothing."""
    return uuid.uuid4().hex[:12]


def require(settings: Settings, name: str, port: int) -> None:
    if not port_open(settings.host, port):
        pytest.fail(
            f"{name} is not reachable on {settings.host}:{port}; start the stack with "
            f"`tandoor infra up` (scripts/test.sh does it) with the same TANDOOR_* settings",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def kafka(settings: Settings) -> str:
    require(settings, "Kafka", settings.kafka_port)
    return settings.kafka_bootstrap


@pytest.fixture(scope="session")
def cassandra(settings: Settings) -> Settings:
    require(settings, "Cassandra", settings.cassandra_port)
    return settings


@pytest.fixture(scope="session")
def redis_url(settings: Settings) -> str:
    require(settings, "Redis", settings.redis_port)
    return settings.redis_url


@pytest.fixture
def migrated_keyspace(cassandra: Settings, unique: str) -> Iterator[str]:
    """A keyspace of this test's own with every migration applied; dropped afterwards."""
    name = f"t_{unique}"
    with cassandra_session(cassandra) as session:
        migrate(session, name)
    yield name
    with cassandra_session(cassandra) as session:
        session.execute(f"DROP KEYSPACE IF EXISTS {name}")
