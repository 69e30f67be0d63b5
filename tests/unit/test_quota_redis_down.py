"""Quotas when Redis cannot be reached: each tier's `redis_down` policy, with a client
pointed at a port nobody listens on."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from infra.process import free_port
from tandoor.policies.quota import Admission, QuotaExceeded, Quotas, QuotaUnavailable
from tandoor.settings import TierPolicy

OPEN = TierPolicy(
    band="interactive-paid",
    requests_per_minute=1,
    tokens_per_minute=10,
    concurrent_streams=2,
    redis_down="open",
)
CLOSED = OPEN.model_copy(update={"redis_down": "closed"})


@pytest.fixture
async def quotas() -> AsyncIterator[Quotas]:
    client = aioredis.Redis(host="127.0.0.1", port=free_port(), retry=Retry(NoBackoff(), 0))
    yield Quotas(client)
    await client.aclose()


async def test_a_fail_open_tier_is_admitted_uncounted_beyond_its_rate_limits(
    quotas: Quotas,
) -> None:
    first = await quotas.admit("ada", OPEN, "r1", tokens=1000, now_ms=0)
    second = await quotas.admit("ada", OPEN, "r2", tokens=1000, now_ms=0)
    assert not first.counted and not second.counted  # over rpm and tpm, still served
    await quotas.settle(first, 5)  # nothing to settle, and no error


async def test_a_fail_open_tier_still_has_its_concurrent_streams_per_replica(
    quotas: Quotas,
) -> None:
    held = [await quotas.admit("ada", OPEN, f"r{i}", 1, 0) for i in range(2)]
    with pytest.raises(QuotaExceeded) as exceeded:
        await quotas.admit("ada", OPEN, "r3", 1, 0)
    assert exceeded.value.limit == "concurrent_streams"
    assert await quotas.admit("bob", OPEN, "r4", 1, 0)  # another user has their own
    await quotas.release(held[0])
    assert await quotas.admit("ada", OPEN, "r5", 1, 0)  # a slot was freed
    assert await quotas.admit("ada", OPEN, "batch", 1, 0, holds_stream=False)


async def test_a_fail_closed_tier_is_refused(quotas: Quotas) -> None:
    with pytest.raises(QuotaUnavailable) as refused:
        await quotas.admit("ada", CLOSED, "r1", 1, 0)
    assert refused.value.retry_after_s >= 1


async def test_settling_a_counted_request_while_redis_is_down_does_not_fail(
    quotas: Quotas,
) -> None:
    counted = Admission("ada", "r1", window_start_ms=0, estimated_tokens=10)
    await quotas.settle(counted, 3)
    await quotas.release(counted)
