"""Redis is real: a Lua script runs atomically under concurrent callers."""

from __future__ import annotations

import asyncio
import uuid

import redis.asyncio as aioredis

from tandoor.clients import REDIS_MAX_CONNECTIONS

# Fixed-window counter: admit while the window's count stays within the limit,
# otherwise answer with the milliseconds left in the window.
WINDOW_LIMIT = """
local count = redis.call('INCR', KEYS[1])
if count == 1 then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
if count > tonumber(ARGV[1]) then return -redis.call('PTTL', KEYS[1]) end
return count
"""


async def test_lua_script_admits_exactly_the_limit(redis_url: str, unique: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        script = client.register_script(WINDOW_LIMIT)
        key = f"test:window:{unique}"
        results = await asyncio.gather(*(script(keys=[key], args=[20, 60_000]) for _ in range(50)))
        admitted = sorted(r for r in results if r > 0)
        refused = [r for r in results if r <= 0]
        assert admitted == list(range(1, 21))
        assert len(refused) == 30
        assert all(-60_000 <= r < 0 for r in refused)
        await client.delete(key)
    finally:
        await client.aclose()


async def test_more_calls_at_once_than_connections_wait_for_one(redis: aioredis.Redis) -> None:
    """redis-py's pool refused the 101st call at once with a ConnectionError, which every
    caller reads as Redis down: a busy, healthy replica refused free users and admitted
    paid ones uncounted. Calls past the pool wait for a connection instead."""
    key = f"test:pool:{uuid.uuid4().hex}"
    held_s = 0.2  # each call holds its connection this long
    calls = [redis.blpop([key], timeout=held_s) for _ in range(3 * REDIS_MAX_CONNECTIONS // 2)]
    assert await asyncio.gather(*calls) == [None] * len(calls)
