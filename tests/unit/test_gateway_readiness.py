"""The gateway's /ready with Redis down, refusing or frozen: the paid tiers are still
served (fail open), so the replica stays in the load balancer and its answer names
Redis. A ping that raised made it `{"checks": false}` and 503 on every replica."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from producers.gateway.services import READY_WITHOUT, Services
from tandoor.ops import run_checks


class RefusingRedis:
    async def ping(self) -> bool:
        raise RedisConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")


class FrozenRedis:
    async def ping(self) -> bool:
        await asyncio.Event().wait()  # took the connection, never answers
        return True


class AnsweringRedis:
    async def ping(self) -> bool:
        return True


def gateway(redis: Any, kafka: bool = True) -> Any:
    deps = SimpleNamespace(
        redis=redis,
        fanout=SimpleNamespace(ready=kafka),
        streams=SimpleNamespace(draining=asyncio.Event()),
    )
    host = SimpleNamespace(is_up=True)
    cluster = SimpleNamespace(metadata=SimpleNamespace(all_hosts=lambda: [host]))
    return SimpleNamespace(chat=SimpleNamespace(deps=deps), cluster=cluster)


async def ready(services: Any) -> tuple[bool, dict[str, bool]]:
    return await run_checks(lambda: Services.readiness(services), READY_WITHOUT)


@pytest.mark.parametrize("redis", [RefusingRedis(), FrozenRedis()], ids=["refusing", "frozen"])
async def test_a_gateway_without_redis_stays_ready_and_says_so(redis: Any) -> None:
    assert await ready(gateway(redis)) == (
        True,
        {"redis": False, "cassandra": True, "kafka": True, "accepting": True},
    )


async def test_a_gateway_without_kafka_is_unready_and_says_why() -> None:
    ok, checks = await ready(gateway(AnsweringRedis(), kafka=False))
    assert not ok and checks["kafka"] is False and checks["redis"] is True
