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
import datetime as dt
import itertools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import redis.asyncio as aioredis

from consumers.history import reply_slot_ms
from producers.gateway.conversations.protocol import ConversationWithMessages, Message
from producers.gateway.conversations.rows import from_ms
from tandoor.clients import CASSANDRA_DOWN, REDIS_DOWN
from tandoor.policies.redis_keys import REPLY_TTL_S, newest_reply_key

log = logging.getLogger(__name__)

STORE_WAIT_S = 5.0  # persistence is behind by far less, unless it is down
_POLL_S = (0.02, 0.05, 0.1, 0.2, 0.4)  # then every 0.5 s

# "<prompt ms>:<request id>", replaced only by a newer prompt (a slow gateway noting an
# older reply must not hide the newer one from the wait). KEYS: the note; ARGV: prompt
# ms, request id, ttl s.
NOTE_NEWER = """
local held = redis.call('GET', KEYS[1])
if held and tonumber(string.match(held, '^(%d+):')) >= tonumber(ARGV[1]) then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. ARGV[2], 'EX', tonumber(ARGV[3]))
return 1
"""


@dataclass(frozen=True)
class Newest:
    request_id: str
    prompt_at_ms: int

    @property
    def slot(self) -> dt.datetime:
        """Where the persistence consumer stores the reply in its conversation."""
        return from_ms(reply_slot_ms(self.prompt_at_ms))

    def stand_in(self) -> Message:
        """The reply's row by its key: enough to replace it before it is stored."""
        return Message(
            id=self.request_id, role="assistant", content="", status=None, created_at=self.slot
        )


Stored = Callable[[Newest], Awaitable[bool]]


class NewestReply:
    def __init__(self, redis: aioredis.Redis, wait_s: float = STORE_WAIT_S) -> None:
        self._redis = redis
        self._wait_s = wait_s
        self._note_newer = redis.register_script(NOTE_NEWER)

    async def note(self, conversation_id: str, newest: Newest) -> None:
        """Once the reply's prompt is queued. Redis down: the next turn does not wait."""
        key = newest_reply_key(conversation_id)
        try:
            await self._note_newer(
                keys=[key], args=[newest.prompt_at_ms, newest.request_id, REPLY_TTL_S]
            )
        except REDIS_DOWN as exc:
            log.warning("%s: newest reply not noted (%s)", conversation_id, exc)

    async def settled(
        self,
        conversation_id: str,
        read: Callable[[], Awaitable[ConversationWithMessages]],
        stored: Stored,
    ) -> tuple[ConversationWithMessages, Message | None]:
        """The conversation (`read`) once its newest reply is stored, and that reply's
        stand-in if it was not within the wait (`stored` probes its one row)."""
        newest = await self._newest(conversation_id)
        opened = await read()
        if newest is None or any(m.id == newest.request_id for m in opened.messages):
            return opened, None
        if await self._stored_within_wait(newest, stored):
            return await read(), None
        log.warning(
            "%s: reply %s not stored within %.1f s; going on without it",
            conversation_id,
            newest.request_id,
            self._wait_s,
        )
        return opened, newest.stand_in()

    async def _stored_within_wait(self, newest: Newest, stored: Stored) -> bool:
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + self._wait_s
        for poll_s in itertools.chain(_POLL_S, itertools.repeat(0.5)):
            pause = min(poll_s, give_up_at - loop.time())
            if pause <= 0:
                return False
            await asyncio.sleep(pause)
            try:
                if await stored(newest):
                    return True
            except CASSANDRA_DOWN as exc:  # the probe is no reason to fail the turn
                log.warning("%s: probing for the stored reply failed (%s)", newest.request_id, exc)
                return False
        return False  # not reached: the poll intervals never end

    async def _newest(self, conversation_id: str) -> Newest | None:
        try:
            raw = await self._redis.get(newest_reply_key(conversation_id))
        except REDIS_DOWN as exc:
            log.warning("%s: newest reply unknown (%s)", conversation_id, exc)
            return None
        if raw is None:
            return None
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        prompt_at, _, request_id = text.partition(":")
        return Newest(request_id, int(prompt_at))
