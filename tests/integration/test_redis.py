"""Redis is real: a Lua script runs atomically under concurrent callers."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

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
