"""A conversation's newest reply, until it is stored. The persistence consumer writes a
reply a moment after its stream ends; a turn asked in that moment (a follow-up, a
regenerate, an edit) would read the conversation without it: the model's context would
lack its own last answer, and a regenerate would leave the old reply shown beside the
new one. So the next turn waits, briefly, for the reply to be stored. Past the wait it
goes on without it, and a regenerate or an edit still hides it by its key: the replace
is written later than the reply's own timestamp (consumers/history.py), so it wins in
whichever order the two reach Cassandra."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import orjson
import redis.asyncio as aioredis

from consumers.history import reply_slot_ms
from producers.gateway.conversations.protocol import ConversationWithMessages, Message
from producers.gateway.conversations.service import from_ms
from tandoor.clients import REDIS_DOWN
from tandoor.policies.redis_keys import REPLY_TTL_S, newest_reply_key

log = logging.getLogger(__name__)

STORE_WAIT_S = 5.0  # persistence is behind by far less, unless it is down
_POLL_S = (0.02, 0.05, 0.1, 0.2, 0.4)  # then every 0.5 s


@dataclass(frozen=True)
class Newest:
    request_id: str
    prompt_at_ms: int

    def stand_in(self) -> Message:
        """The reply's row as the persistence consumer keys it: enough to replace it."""
        at = from_ms(reply_slot_ms(self.prompt_at_ms))
        return Message(id=self.request_id, role="assistant", content="", status=None, created_at=at)


class NewestReply:
    def __init__(self, redis: aioredis.Redis, wait_s: float = STORE_WAIT_S) -> None:
        self._redis = redis
        self._wait_s = wait_s

    async def note(self, conversation_id: str, newest: Newest) -> None:
        """Once the reply's prompt is queued. Redis down: the next turn does not wait."""
        record = orjson.dumps({"request_id": newest.request_id, "at": newest.prompt_at_ms})
        try:
            await self._redis.set(newest_reply_key(conversation_id), record, ex=REPLY_TTL_S)
        except REDIS_DOWN as exc:
            log.warning("%s: newest reply not noted (%s)", conversation_id, exc)

    async def settled(
        self, conversation_id: str, read: Callable[[], Awaitable[ConversationWithMessages]]
    ) -> tuple[ConversationWithMessages, Message | None]:
        """The conversation once its newest reply is stored, and that reply's stand-in
        if it was not within the wait."""
        newest = await self._newest(conversation_id)
        opened = await read()
        if newest is None:
            return opened, None
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + self._wait_s
        for poll_s in itertools.chain(_POLL_S, itertools.repeat(0.5)):
            if any(m.id == newest.request_id for m in opened.messages):
                return opened, None
            pause = min(poll_s, give_up_at - loop.time())
            if pause <= 0:
                break
            await asyncio.sleep(pause)
            opened = await read()
        log.warning(
            "%s: reply %s not stored after %.1f s; going on without it",
            conversation_id,
            newest.request_id,
            self._wait_s,
        )
        return opened, newest.stand_in()

    async def _newest(self, conversation_id: str) -> Newest | None:
        try:
            raw = await self._redis.get(newest_reply_key(conversation_id))
        except REDIS_DOWN as exc:
            log.warning("%s: newest reply unknown (%s)", conversation_id, exc)
            return None
        if raw is None:
            return None
        record = orjson.loads(raw)
        return Newest(str(record["request_id"]), int(record["at"]))
