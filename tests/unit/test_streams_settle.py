"""The streams app settles each usage record's quota in Redis on the one actor that
counts every `usage` partition. With Redis unreachable, every record waited out the
client's timeouts (0.6 s refused, about 4 s black-holed): the rollups fell behind for as
long as Redis was out. Now one failure skips settling for a few seconds (a slot's lease
and a minute's window end by themselves); a Redis that answers with an error (MISCONF)
does not stop counting either."""

from __future__ import annotations

from typing import Any, cast

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from schemas.events import UsageRecord
from streams.outputs import SETTLE_PAUSE_S, Settler
from tandoor.policies.quota import Quotas
from tests.unit.test_streams_agents import usage


class FailingRedis:
    """A Redis client whose every call fails with `error`, counting the calls."""

    def __init__(self, error: Exception) -> None:
        self.error, self.calls = error, 0

    def register_script(self, script: str) -> Any:
        async def run(**_: Any) -> None:
            await self.fail()

        return run

    async def zrem(self, *_: Any) -> None:
        await self.fail()

    async def fail(self) -> None:
        self.calls += 1
        raise self.error


def charged(request_id: str) -> UsageRecord:
    return usage(request_id).model_copy(update={"charged_tokens": 9, "charged_at_ms": 120_000})


async def test_after_redis_fails_settling_is_skipped_for_a_while() -> None:
    redis = FailingRedis(RedisConnectionError("connection refused"))
    clock = [1000.0]
    settler = Settler(Quotas(cast(Any, redis)), clock=lambda: clock[0])
    await settler.settle(charged("a"))
    tried = redis.calls
    assert tried >= 1
    for request_id in ("b", "c", "d"):
        await settler.settle(charged(request_id))
    assert redis.calls == tried, "each record waited for Redis again"
    assert settler.skipped == 3
    clock[0] += SETTLE_PAUSE_S + 0.1
    await settler.settle(charged("e"))
    assert redis.calls > tried, "Redis is tried again after the pause"


async def test_a_redis_answering_with_errors_does_not_stop_counting() -> None:
    redis = FailingRedis(ResponseError("MISCONF Redis is configured to save RDB snapshots"))
    settler = Settler(Quotas(cast(Any, redis)))
    await settler.settle(charged("a"))  # raised out of the agent, record after record
    assert redis.calls >= 1
