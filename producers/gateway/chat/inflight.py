"""The reply each conversation is generating now, in Redis: what stop, resume and the
one-reply-at-a-time check read. Set when a prompt is queued, cleared by its final."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import orjson
import redis.asyncio as aioredis

from consumers.fanout import Subscription
from producers.gateway.errors import ApiError
from tandoor.clients import REDIS_DOWN
from tandoor.policies.redis_keys import inflight_key

log = logging.getLogger(__name__)

INFLIGHT_TTL_S = 3600


class InFlight:
    def __init__(self, redis: aioredis.Redis) -> None:
        self._redis = redis

    async def mark(self, conversation_id: str, sub: Subscription) -> None:
        """Where the reply's events start; Redis down: the reply still streams, and stop
        and resume wait for Redis."""
        record = {
            "request_id": sub.request_id,
            "partition": sub.partition,
            "offset": sub.next_offset,
        }
        try:
            await self._redis.set(
                inflight_key(conversation_id), orjson.dumps(record), ex=INFLIGHT_TTL_S
            )
        except REDIS_DOWN as exc:
            log.warning("%s: not marked in flight, Redis unreachable (%s)", sub.request_id, exc)

    async def clear(self, conversation_id: str) -> None:
        with contextlib.suppress(*REDIS_DOWN):  # then the mark expires by itself
            await self._redis.delete(inflight_key(conversation_id))

    async def clear_if(self, conversation_id: str, request_id: str) -> None:
        """Clear the mark only if it is still `request_id`'s."""
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
        if await self._redis.exists(inflight_key(conversation_id)):
            raise ApiError(409, "a reply is being generated: stop it first", kind="conflict_error")
