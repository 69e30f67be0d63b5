"""What every worker must agree on about a request, kept in Redis: its attempt
number, whether it already has a final reply, and whether it was cancelled."""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from schemas.keys import ATTEMPT_TTL_S, CANCEL_TTL_S, attempt_key, cancel_key, done_key


@dataclass(frozen=True)
class Arrival:
    """What a worker needs to know about a prompt it just took, in one round trip."""

    done: bool  # a final event was already sent: skip the redelivery
    attempt: int  # 1 the first time; a redelivery after a crash gets the next number
    cancelled: bool


class RequestLedger:
    def __init__(self, client: aioredis.Redis) -> None:
        self._redis = client

    async def arrive(self, request_id: str) -> Arrival:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.exists(done_key(request_id))
            pipe.incr(attempt_key(request_id))
            pipe.expire(attempt_key(request_id), ATTEMPT_TTL_S)
            pipe.exists(cancel_key(request_id))
            done, attempt, _, cancelled = await pipe.execute()
        return Arrival(bool(done), int(attempt), bool(cancelled))

    async def mark_done(self, request_id: str, attempt: int) -> None:
        await self._redis.set(done_key(request_id), attempt, ex=ATTEMPT_TTL_S)

    async def mark_cancelled(self, request_id: str) -> None:
        await self._redis.set(cancel_key(request_id), 1, ex=CANCEL_TTL_S)
