"""The reply each conversation is generating now, in Redis: what stop, resume and the
one-reply-at-a-time rule read. Claimed atomically before the prompt is queued (two
posts at once cannot both run), released by its final. A record left by a gateway
that died is stale once its request is done (a worker published its final) or was
never taken by its start deadline; a new reply may then take its place."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import redis.asyncio as aioredis

from consumers.fanout import Subscription
from producers.gateway.chat.newest import Newest
from producers.gateway.errors import ApiError
from schemas.codec import encode
from schemas.events import FinalEvent, MessageKey, Usage, now_ms
from tandoor.clients import CASSANDRA_DOWN, REDIS_DOWN
from tandoor.policies.redis_keys import (
    ATTEMPT_TTL_S,
    FINAL_TTL_S,
    attempt_key,
    done_key,
    final_key,
    inflight_key,
    lease_key,
)

log = logging.getLogger(__name__)

TTL_S = 3600  # past it a record whose reply was never settled lapses


@dataclass(frozen=True)
class Queued:
    """What a stop needs of the prompt to answer it itself while it waits in Kafka."""

    model: str
    created_at_ms: int
    # A regenerate's or edit's: its cancelled final hides them too, once stored, even
    # when the gateway that queued it died before marking them (and another stops it).
    replaces: Sequence[MessageKey] = ()
    store: bool = True  # False: OpenAI's `store: false`, its cancelled final is not kept
    user_message_id: str | None = None  # a resumed stream's start event names it
    # The tier it was charged in: a stop or a resume may come with the user's key of
    # another tier, and its slot, settlement and final are this one's.
    tier: str | None = None


# A prompt no worker has taken yet, answered as done with `final` (KEYS: attempt, done,
# final, lease; ARGV: final, done ttl s, final ttl s). The lease counts as taken: Redis
# restarted empty, a running reply's worker takes its lease back at its next event, but
# not its attempt key. A worker's arrival checks done first, so
# exactly one of the two gets the request; the worker that takes the prompt later
# delivers this final again with its usage record.
END_UNTAKEN = """
if redis.call('EXISTS', KEYS[1]) == 1 or redis.call('EXISTS', KEYS[4]) == 1
   or redis.call('EXISTS', KEYS[2]) == 1 then
  return 0  -- a worker has it (or holds its lease), or it is done (a second stop)
end
redis.call('SET', KEYS[2], '1', 'EX', tonumber(ARGV[2]))
redis.call('SET', KEYS[3], ARGV[1], 'EX', tonumber(ARGV[3]))
return 1
"""

# Replace a stale record only if it is still the one judged stale.
REPLACE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'EX', tonumber(ARGV[3]))
  return 1
end
return 0
"""


# Drop the record only if it is ARGV[1]'s: read then deleted in two steps, a record
# claimed in between (its reply ended, the next post claimed at once) was deleted.
RELEASE = """
local held = redis.call('GET', KEYS[1])
if held and cjson.decode(held)['request_id'] == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


# Whether a conversation's reply is stored (consumers/persist.py writes only finished ones).
StoredReply = Callable[[str, Newest], Awaitable[bool]]


def charged_tier(record: dict[str, Any], caller_tier: str) -> str:
    """The tier a recorded reply was charged in (a record from before it was kept: the
    caller's)."""
    tier = record.get("tier")
    return tier if isinstance(tier, str) else caller_tier


class InFlight:
    def __init__(self, redis: aioredis.Redis, stored: StoredReply | None = None) -> None:
        self.redis = redis
        self._stored = stored
        self._replace = redis.register_script(REPLACE)
        self._end_untaken = redis.register_script(END_UNTAKEN)
        self._release = redis.register_script(RELEASE)
        # This gateway's running replies by conversation, as recorded: what rerecord
        # writes back when Redis lost them (restarted empty, or down at the claim).
        self._held: dict[str, bytes] = {}

    async def claim(
        self, conversation_id: str, sub: Subscription, start_by_ms: int, prompt: Queued
    ) -> bool:
        """Record the reply as the conversation's running one, where its events start;
        False if another live reply holds the conversation. Redis down: the reply runs
        unrecorded (stop and resume wait for Redis)."""
        record = orjson.dumps(
            {
                "request_id": sub.request_id,
                "partition": sub.partition,
                "offset": sub.next_offset,
                "start_by_ms": start_by_ms,
                "model": prompt.model,
                "prompt_at_ms": prompt.created_at_ms,
                "conversation_id": conversation_id,
                "replaces": [key.model_dump() for key in prompt.replaces],
                "store": prompt.store,
                "user_message_id": prompt.user_message_id,
                "tier": prompt.tier,
                "queued": False,  # until mark_queued: the request may still be refused
            }
        )
        try:
            claimed = await self._claim(inflight_key(conversation_id), record)
        except REDIS_DOWN as exc:
            log.warning("%s: not marked in flight, Redis unreachable (%s)", sub.request_id, exc)
            claimed = True
        if claimed:
            self._held[conversation_id] = record
        return claimed

    async def _claim(self, key: str, record: bytes) -> bool:
        if await self.redis.set(key, record, nx=True, ex=TTL_S):
            return True
        held = await self.redis.get(key)
        if held is None or not await self._stale(orjson.loads(held)):
            return False
        return bool(await self._replace(keys=[key], args=[held, record, TTL_S]))

    async def mark_queued(self, conversation_id: str, request_id: str) -> None:
        """The prompt is in Kafka: from now on a stop may answer it itself. Redis down:
        it stays unmarked, and a stop reaches the prompt through its cancel key (the
        record written back once Redis answers says queued)."""
        kept = self._held.get(conversation_id)
        if kept is not None and orjson.loads(kept)["request_id"] == request_id:
            self._held[conversation_id] = orjson.dumps({**orjson.loads(kept), "queued": True})
        key = inflight_key(conversation_id)
        with contextlib.suppress(*REDIS_DOWN):
            held = await self.redis.get(key)
            if held is None or orjson.loads(held)["request_id"] != request_id:
                return
            queued = orjson.dumps({**orjson.loads(held), "queued": True})
            await self._replace(keys=[key], args=[held, queued, TTL_S])

    async def _stale(self, record: dict[str, Any]) -> bool:
        """Its request is done, or nobody took it before it had to start, or its reply is
        stored: with Redis unreachable as it ended, neither its worker's done mark nor
        the gateway's release was written, and the chat was a 409 for an hour."""
        if await self.redis.exists(done_key(record["request_id"])):
            return True
        return await self.abandoned(record) or await self._reply_stored(record)

    async def _reply_stored(self, record: dict[str, Any]) -> bool:
        if self._stored is None or "prompt_at_ms" not in record:
            return False
        newest = Newest(record["request_id"], int(record["prompt_at_ms"]))
        try:
            return await self._stored(record["conversation_id"], newest)
        except CASSANDRA_DOWN as exc:
            log.warning("%s: cannot tell if its reply is stored (%s)", newest.request_id, exc)
            return False

    async def end_untaken(
        self, record: dict[str, Any], user_id: str, tier: str
    ) -> FinalEvent | None:
        """The recorded reply's final, cancelled, if no worker has taken its prompt yet
        (the caller publishes it); None if one has, or the record predates the fields,
        or the prompt is not queued yet: its request may still be refused (a quota, a
        context too long, Kafka down), which must leave the conversation as it was, and
        if it is queued after all, its cancel key stops it."""
        if "model" not in record or not record.get("queued", True):
            return None
        final = _cancelled_in_queue(record, user_id, charged_tier(record, tier))
        request_id = final.request_id
        keys = [
            attempt_key(request_id),
            done_key(request_id),
            final_key(request_id),
            lease_key(request_id),
        ]
        args: list[bytes | int] = [encode(final), ATTEMPT_TTL_S, FINAL_TTL_S]
        return final if await self._end_untaken(keys=keys, args=args) else None

    async def abandoned(self, record: dict[str, Any]) -> bool:
        """Nobody took its request before it had to start: its gateway died before
        queueing it, or no worker came. It will never answer."""
        request_id = record["request_id"]
        # Its lease too: Redis restarted empty, the worker takes it back, not the attempt.
        taken = await self.redis.exists(attempt_key(request_id), lease_key(request_id))
        return not taken and now_ms() > int(record.get("start_by_ms", 0))

    async def release(self, conversation_id: str, request_id: str) -> None:
        """Drop the record if it is still `request_id`'s (another reply's stays)."""
        kept = self._held.get(conversation_id)
        if kept is not None and orjson.loads(kept)["request_id"] == request_id:
            del self._held[conversation_id]
        with contextlib.suppress(*REDIS_DOWN):  # then the record expires by itself
            await self._release(keys=[inflight_key(conversation_id)], args=[request_id])

    async def rerecord(self) -> int:
        """Write back this gateway's records that Redis no longer has (none is replaced:
        a key that holds another reply's record keeps it); how many were missing. Without
        it, a reply started while Redis was down, or running as it restarted empty, could
        not be stopped (a 409) and a regenerate ran beside it."""
        if not self._held:
            return 0
        async with self.redis.pipeline(transaction=False) as pipe:
            for conversation_id, record in list(self._held.items()):
                pipe.set(inflight_key(conversation_id), record, nx=True, ex=TTL_S)
            written = await pipe.execute()
        return sum(1 for was_set in written if was_set)

    async def current(self, conversation_id: str) -> dict[str, Any] | None:
        """{"request_id", "partition", "offset"} of the running reply, or None."""
        raw = await self.redis.get(inflight_key(conversation_id))
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
        """A 409 while another live reply holds the conversation (read only: the claim
        decides; this spares a regenerate or an edit the quota charge of a refusal)."""
        held = await self.current(conversation_id)
        if held is not None and not await self._stale(held):
            raise ApiError(409, "a reply is being generated: stop it first", kind="conflict_error")


def _cancelled_in_queue(record: dict[str, Any], user_id: str, tier: str) -> FinalEvent:
    """The final a worker would publish for a prompt cancelled before it started."""
    # Another gateway's clock may be behind the one that queued it.
    prompt_at = int(record["prompt_at_ms"])
    at = max(now_ms(), prompt_at)
    return FinalEvent(
        request_id=record["request_id"],
        attempt=1,
        seq=0,
        finish_reason="cancelled",
        text="",
        usage=Usage(prompt_tokens=0, completion_tokens=0, queue_ms=at - prompt_at, decode_ms=0),
        model=record["model"],
        user_id=user_id,
        tier=tier,
        conversation_id=record["conversation_id"],
        created_at_ms=at,
        prompt_created_at_ms=prompt_at,
        replaces=[MessageKey.model_validate(key) for key in record.get("replaces", [])],
        store=bool(record.get("store", True)),
    )
