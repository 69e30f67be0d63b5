from __future__ import annotations

import pytest

from infra.process import port_open
from tandoor.settings import Settings


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
