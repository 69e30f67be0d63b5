"""What every worker must agree on about a request, kept in Redis: its attempt
number, whether it already has a final reply, and whether it was cancelled."""

from __future__ import annotations

import redis.asyncio as aioredis

from schemas.keys import ATTEMPT_TTL_S, CANCEL_TTL_S, attempt_key, cancel_key, done_key


class RequestLedger:
    def __init__(self, client: aioredis.Redis) -> None:
        self._redis = client

    async def begin_attempt(self, request_id: str) -> int:
        """1 the first time; a redelivery after a crash gets the next number."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.incr(attempt_key(request_id))
            pipe.expire(attempt_key(request_id), ATTEMPT_TTL_S)
            attempt, _ = await pipe.execute()
        return int(attempt)

    async def mark_done(self, request_id: str, attempt: int) -> None:
        await self._redis.set(done_key(request_id), attempt, ex=ATTEMPT_TTL_S)

    async def is_done(self, request_id: str) -> bool:
        return bool(await self._redis.exists(done_key(request_id)))

    async def mark_cancelled(self, request_id: str) -> None:
        await self._redis.set(cancel_key(request_id), 1, ex=CANCEL_TTL_S)

    async def is_cancelled(self, request_id: str) -> bool:
        return bool(await self._redis.exists(cancel_key(request_id)))
