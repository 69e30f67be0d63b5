"""What every worker must agree on about a request, kept in Redis: its attempt
number, whether it already has a final reply, and whether it was cancelled.

Redis unreachable: the worker keeps serving (the gateway admitted the prompt under
its tier's Redis-down policy, see tandoor/policies/quota.py). The prompt is taken as a first
attempt, neither done nor cancelled; marks that cannot be written are skipped. What is
lost meanwhile: a prompt redelivered after a worker crash during the outage runs
again as attempt 1 (clients skip what they already have by sequence number), and a
cancel reaches only the worker running the request (the control topic still works).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis.asyncio as aioredis

from tandoor.clients import REDIS_DOWN
from tandoor.policies.redis_keys import (
    ATTEMPT_TTL_S,
    CANCEL_TTL_S,
    attempt_key,
    cancel_key,
    done_key,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Arrival:
    """What a worker needs to know about a prompt it just took, in one round trip."""

    done: bool  # a final event was already sent: skip the redelivery
    attempt: int  # 1 the first time; a redelivery after a crash gets the next number
    cancelled: bool


FIRST_ARRIVAL = Arrival(done=False, attempt=1, cancelled=False)


class RequestLedger:
    def __init__(self, client: aioredis.Redis) -> None:
        self._redis = client

    async def arrive(self, request_id: str) -> Arrival:
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.exists(done_key(request_id))
                pipe.incr(attempt_key(request_id))
                pipe.expire(attempt_key(request_id), ATTEMPT_TTL_S)
                pipe.exists(cancel_key(request_id))
                done, attempt, _, cancelled = await pipe.execute()
        except REDIS_DOWN as exc:
            log.warning("%s: Redis unreachable (%s); taken as a first attempt", request_id, exc)
            return FIRST_ARRIVAL
        return Arrival(bool(done), int(attempt), bool(cancelled))

    async def mark_done(self, request_id: str, attempt: int) -> None:
        await self._mark(done_key(request_id), attempt, ATTEMPT_TTL_S)

    async def mark_cancelled(self, request_id: str) -> None:
        await self._mark(cancel_key(request_id), 1, CANCEL_TTL_S)

    async def _mark(self, key: str, value: int, ttl_s: int) -> None:
        try:
            await self._redis.set(key, value, ex=ttl_s)
        except REDIS_DOWN as exc:
            log.warning("Redis unreachable (%s); %s not recorded", exc, key)
