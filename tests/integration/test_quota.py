"""Quotas against real Redis: exact limits, atomic under concurrency, settled, released."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from tandoor.policies.api_keys import Principal
from tandoor.policies.quota import (
    STREAM_LEASE_MS,
    Admission,
    QuotaExceeded,
    Quotas,
    QuotaUnavailable,
)
from tandoor.policies.redis_keys import tokens_window_key
from tandoor.settings import TierPolicy

pytestmark = pytest.mark.integration


def policy(rpm: int = 100, tpm: int = 100_000, streams: int = 100) -> TierPolicy:
    return TierPolicy(
        band="batch", requests_per_minute=rpm, tokens_per_minute=tpm, concurrent_streams=streams
    )


@pytest.fixture
async def quotas(redis_url: str) -> AsyncIterator[Quotas]:
    client = aioredis.Redis.from_url(redis_url)
    yield Quotas(client)
    await client.aclose()


@pytest.fixture
def t0() -> int:
    """One instant early in the next window for the whole test: every call shares one
    window (no flake at a minute boundary) and the keys outlive the test."""
    wall = int(time.time() * 1000)
    return wall - wall % 60_000 + 60_000 + 1_000


async def test_requests_per_minute_is_exact_and_says_when_to_retry(
    quotas: Quotas, unique: str, t0: int
) -> None:
    for i in range(3):
        await quotas.admit(unique, policy(rpm=3), f"r{i}", 10, t0)
    with pytest.raises(QuotaExceeded) as info:
        await quotas.admit(unique, policy(rpm=3), "r3", 10, t0)
    assert info.value.limit == "requests_per_minute"
    assert 1 <= info.value.retry_after_s <= 60


async def test_requests_per_minute_slide_across_the_minute_boundary(
    quotas: Quotas, unique: str, t0: int
) -> None:
    late = t0 + 58_000  # the end of one clock minute
    for i in range(2):
        await quotas.admit(unique, policy(rpm=2), f"r{i}", 10, late)
    with pytest.raises(QuotaExceeded) as info:  # a new clock minute, the same last minute
        await quotas.admit(unique, policy(rpm=2), "r2", 10, late + 3_000)
    assert info.value.retry_after_s == 57
    await quotas.admit(unique, policy(rpm=2), "r2", 10, late + 60_001)


async def test_tokens_are_settled_with_real_usage(quotas: Quotas, unique: str, t0: int) -> None:
    # Settled once per request id, across tests and runs: the id is this test's own.
    first = await quotas.admit(unique, policy(tpm=1000), f"a-{unique}", 600, t0)
    with pytest.raises(QuotaExceeded, match="tokens per minute"):
        await quotas.admit(unique, policy(tpm=1000), "b", 600, t0)
    await quotas.settle(first, actual_tokens=300)  # the estimate was too high
    await quotas.admit(unique, policy(tpm=1000), "b", 600, t0)


async def test_a_caller_whose_clock_is_behind_redis_keeps_the_minute_counted(
    quotas: Quotas, unique: str
) -> None:
    """The window's key expired at the end of the caller's minute by Redis's clock: from a
    host a few seconds behind, a charge in its minute's last seconds set an expiry already
    past, and Redis dropped the key with every charge of that minute in it."""
    seconds, micros = await quotas._redis.time()
    redis_now = seconds * 1000 + micros // 1000
    behind = redis_now - redis_now % 60_000 - 1_000  # 1 s before a minute Redis has ended
    await quotas.admit(unique, policy(tpm=1000), "first", 600, behind)
    with pytest.raises(QuotaExceeded, match="tokens per minute"):
        await quotas.admit(unique, policy(tpm=1000), "second", 600, behind + 10)


async def test_a_caller_whose_clock_is_ahead_does_not_end_the_minute_for_the_others(
    quotas: Quotas, unique: str, t0: int
) -> None:
    """Expiring the window's key by the writer's clock alone, a host ahead charging in
    what it took for the minute's last second left the key a second to live: the
    charges every host had made that minute went with it."""
    await quotas.admit(unique, policy(tpm=1000), "ahead", 600, t0 + 58_000)
    left_ms = await quotas._redis.pttl(tokens_window_key(unique, t0 - t0 % 60_000))
    assert left_ms > 60_000, f"the minute's count expires in {left_ms} ms"
    with pytest.raises(QuotaExceeded, match="tokens per minute"):
        await quotas.admit(unique, policy(tpm=1000), "behind", 600, t0)


async def test_the_same_request_admitted_again_is_charged_once(
    quotas: Quotas, unique: str, t0: int
) -> None:
    """Batch admission retries a line whose produce failed, and replays it after a
    crash: its tokens and its request are counted once."""
    for at in (t0, t0 + 1_000, t0 + 59_500):  # the last in the next window
        again = await quotas.admit(unique, policy(rpm=2, tpm=1000), "line", 600, at)
        assert again.charged_at_ms == t0  # its usage record settles the minute charged
        assert again.window_start_ms == t0 - t0 % 60_000
    await quotas.admit(unique, policy(rpm=2, tpm=1000), "other", 400, t0)
    with pytest.raises(QuotaExceeded, match="requests per minute"):
        await quotas.admit(unique, policy(rpm=2, tpm=1000), "third", 1, t0)


async def test_each_tier_a_user_holds_a_key_of_counts_its_own_requests(
    quotas: Quotas, unique: str, t0: int
) -> None:
    """One counter per user, each key's tier's limits on it: a batch key's lines (6,000 a
    minute) refused the same user's chat key at its 60, for as long as the batch ran,
    with a Retry-After that never held."""
    bulk, chat = Principal(unique, "batch", "k-bulk"), Principal(unique, "plus", "k-chat")
    for i in range(3):
        await quotas.admit(bulk.quota_account, policy(rpm=3, tpm=100), f"b{i}", 30, t0)
    with pytest.raises(QuotaExceeded):
        await quotas.admit(bulk.quota_account, policy(rpm=3, tpm=100), "b3", 1, t0)
    await quotas.admit(chat.quota_account, policy(rpm=1, tpm=10), "c0", 10, t0)  # untouched
    used = await quotas.in_use(chat.quota_account, t0)
    assert used is not None and (used.requests, used.tokens) == (1, 10)


async def test_a_refused_request_is_not_charged(quotas: Quotas, unique: str, t0: int) -> None:
    with pytest.raises(QuotaExceeded):
        await quotas.admit(unique, policy(rpm=2, tpm=100), "big", 500, t0)
    await quotas.admit(unique, policy(rpm=2, tpm=100), "s1", 10, t0)
    await quotas.admit(unique, policy(rpm=2, tpm=100), "s2", 10, t0)


async def test_concurrent_streams_are_held_until_released(
    quotas: Quotas, unique: str, t0: int
) -> None:
    held = [await quotas.admit(unique, policy(streams=2), f"s{i}", 1, t0) for i in range(2)]
    with pytest.raises(QuotaExceeded) as info:
        await quotas.admit(unique, policy(streams=2), "s2", 1, t0)
    assert info.value.limit == "concurrent_streams"
    await quotas.release(held[0])
    await quotas.admit(unique, policy(streams=2), "s2", 1, t0)


async def test_a_stream_never_released_stops_counting_after_its_lease(
    quotas: Quotas, unique: str, t0: int
) -> None:
    await quotas.admit(unique, policy(streams=1), "lost", 1, t0)
    later = t0 + STREAM_LEASE_MS + 1
    await quotas.admit(unique, policy(streams=1), "next", 1, later)


async def test_admission_is_atomic_under_concurrent_callers(
    quotas: Quotas, unique: str, t0: int
) -> None:
    async def try_once(i: int) -> Admission | None:
        try:
            return await quotas.admit(unique, policy(rpm=20), f"r{i}", 1, t0)
        except QuotaExceeded:
            return None

    results = await asyncio.gather(*(try_once(i) for i in range(60)))
    assert sum(r is not None for r in results) == 20


async def bgsave_status(client: aioredis.Redis) -> str:
    """The last snapshot's outcome, once none is running."""
    while True:
        info = await client.info("persistence")
        if not info["rdb_bgsave_in_progress"]:
            return str(info["rdb_last_bgsave_status"])
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def refusing_writes(client: aioredis.Redis) -> AsyncIterator[None]:
    """This Redis as after a snapshot failed on a full disk: MISCONF on every write.
    Its snapshot file is made a folder, so the snapshot cannot be renamed into place."""
    settings = {name: str((await client.config_get(name))[name]) for name in ("dir", "dbfilename")}
    snapshot = Path(settings["dir"]) / settings["dbfilename"]
    snapshot.unlink(missing_ok=True)
    snapshot.mkdir()
    saves = str((await client.config_get("save"))["save"])
    try:
        await client.config_set("save", "3600 1")  # refused writes need snapshots on
        await client.bgsave()
        assert await bgsave_status(client) == "err"
        yield
    finally:
        snapshot.rmdir()
        await client.bgsave()
        assert await bgsave_status(client) == "ok"
        await client.config_set("save", saves)
        snapshot.unlink(missing_ok=True)


async def test_a_redis_that_cannot_persist_is_redis_down_not_a_crash(
    redis_url: str, unique: str, t0: int
) -> None:
    """MISCONF (a snapshot or an AOF write failed: a full disk) came as a bare
    ResponseError, which no Redis-down policy caught: the gateway answered 500 and the
    batch admission role stopped."""
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    writer = aioredis.Redis.from_url(redis_url)
    quotas = Quotas(writer)
    fail_open = policy().model_copy(update={"redis_down": "open"})
    fail_closed = policy().model_copy(update={"redis_down": "closed"})
    async with refusing_writes(client):
        admitted = await quotas.admit(unique, fail_open, "r1", 10, t0)
        with pytest.raises(QuotaUnavailable):
            await quotas.admit(unique, fail_closed, "r2", 10, t0)
    assert not admitted.counted
    counted = await quotas.admit(unique, fail_closed, "r3", 10, t0)  # writable again
    assert counted.counted
    await asyncio.gather(client.aclose(), writer.aclose())
