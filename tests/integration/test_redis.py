"""Redis is real: a Lua script runs atomically under concurrent callers; calls past the
pool wait for a connection; calls to a Redis gone quiet fail at once after one timed out."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import uuid
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.exceptions import TimeoutError as RedisTimeoutError

from infra.process import free_port
from infra.redis_server import RedisServer
from tandoor.clients import REDIS_DOWN, REDIS_MAX_CONNECTIONS, redis_client
from tandoor.settings import Settings
from tests.waiting import eventually

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


async def test_calls_to_a_redis_gone_quiet_fail_at_once_after_one_timed_out(
    tmp_path: Path,
) -> None:
    """Stopped with its port open, Redis cost every call the whole read timeout: a paid
    chat message, some seven calls, waited 14 s before its Redis-down policy applied."""
    settings = Settings(home=tmp_path, redis_port=free_port())
    server = RedisServer(settings)  # its own: the suite's Redis is not stopped under it
    server.launch()
    server.wait_ready()
    client = redis_client(settings)
    try:
        await client.set("answer", "42")
        pid = server.process.pid()
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(RedisTimeoutError) as waited:
                await client.get("answer")
            assert "not asked" not in str(waited.value)  # sent, and waited for
            for _ in range(5):  # not sent
                with pytest.raises(RedisTimeoutError, match="not asked"):
                    await client.get("answer")
        finally:
            os.kill(pid, signal.SIGCONT)

        async def answer() -> bytes | str | None:
            try:
                return await client.get("answer")
            except REDIS_DOWN:
                return None

        assert await eventually(answer, what="Redis answering again") == b"42"
    finally:
        await client.aclose()
        server.stop()


async def test_calls_to_a_redis_host_gone_quiet_fail_at_once_after_one_connect_timed_out() -> None:
    """A host that stops answering at the network (paused, partitioned) times out the
    connect, not a read: each call still waited its two seconds. A listener whose queue
    is full drops the handshake as such a host does."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(0)
        port = silent.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):  # all the queue holds
            client = redis_client(Settings(redis_port=port))
            try:
                with pytest.raises(RedisTimeoutError) as waited:
                    await client.get("answer")
                assert "not asked" not in str(waited.value)  # tried, and waited for
                for _ in range(5):
                    with pytest.raises(RedisTimeoutError, match="not asked"):
                        await client.get("answer")
            finally:
                await client.aclose()
