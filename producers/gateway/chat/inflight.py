"""The reply each conversation is generating now, in Redis: what stop, resume and the
one-reply-at-a-time rule read. Claimed atomically before the prompt is queued (two
posts at once cannot both run), released by its final. A record left by a gateway
that died is stale once its request is done (a worker published its final) or was
never taken by its start deadline; a new reply may then take its place."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import orjson
import redis.asyncio as aioredis

from consumers.fanout import Subscription
from producers.gateway.errors import ApiError
from schemas.events import now_ms
from tandoor.clients import REDIS_DOWN
from tandoor.policies.redis_keys import attempt_key, done_key, inflight_key

log = logging.getLogger(__name__)

TTL_S = 3600  # past it a record whose reply was never settled lapses


# Replace a stale record only if it is still the one judged stale.
REPLACE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'EX', tonumber(ARGV[3]))
  return 1
end
return 0
"""


class InFlight:
    def __init__(self, redis: aioredis.Redis) -> None:
        self._redis = redis
        self._replace = redis.register_script(REPLACE)

    async def claim(self, conversation_id: str, sub: Subscription, start_by_ms: int) -> bool:
        """Record the reply as the conversation's running one, where its events start;
        False if another live reply holds the conversation. Redis down: the reply runs
        unrecorded (stop and resume wait for Redis)."""
        record = orjson.dumps(
            {
                "request_id": sub.request_id,
                "partition": sub.partition,
                "offset": sub.next_offset,
                "start_by_ms": start_by_ms,
            }
        )
        key = inflight_key(conversation_id)
        try:
            if await self._redis.set(key, record, nx=True, ex=TTL_S):
                return True
            held = await self._redis.get(key)
            if held is None or not await self._stale(orjson.loads(held)):
                return False
            return bool(await self._replace(keys=[key], args=[held, record, TTL_S]))
        except REDIS_DOWN as exc:
            log.warning("%s: not marked in flight, Redis unreachable (%s)", sub.request_id, exc)
            return True

    async def _stale(self, record: dict[str, Any]) -> bool:
        """Its request is done, or nobody took it before it had to start."""
        request_id = record["request_id"]
        if await self._redis.exists(done_key(request_id)):
            return True
        taken = await self._redis.exists(attempt_key(request_id))
        return not taken and now_ms() > int(record.get("start_by_ms", 0))

    async def release(self, conversation_id: str, request_id: str) -> None:
        """Drop the record if it is still `request_id`'s (another reply's stays)."""
        with contextlib.suppress(*REDIS_DOWN):  # then the record expires by itself
            current = await self.current(conversation_id)
            if current is not None and current["request_id"] == request_id:
                await self._redis.delete(inflight_key(conversation_id))

    async def current(self, conversation_id: str) -> dict[str, Any] | None:
        """{"request_id", "partition", "offset"} of the running reply, or None."""
        raw = await self._redis.get(inflight_key(conversation_id))
        return None if raw is None else dict(orjson.loads(raw))

    async def running(self, conversation_id: str, missing_status: int) -> dict[str, Any]:
        """The running reply, or an ApiError with `missing_status` when there is none."""
        current = await self.current(conversation_id)
        if current is None:
            kind = "not_found_error" if missing_status == 404 else "conflict_error"
            raise ApiError(
                missing_status, "no reply is being generated in this conversation", kind=kind
            )
        return current

    async def ensure_idle(self, conversation_id: str) -> None:
        held = await self.current(conversation_id)
        if held is not None and not await self._stale(held):
            raise ApiError(409, "a reply is being generated: stop it first", kind="conflict_error")
