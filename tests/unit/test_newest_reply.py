"""The next turn's wait for the newest reply to be stored (producers/gateway/chat/newest.py),
against an in-memory Redis and a conversation whose reply lands after some reads."""

from __future__ import annotations

import datetime as dt
from typing import cast

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from consumers.history import reply_time_ms
from producers.gateway.chat.newest import Newest, NewestReply
from producers.gateway.conversations.protocol import ConversationWithMessages, Message
from schemas.events import FinalEvent, Usage

AT = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)


class MemoryRedis:
    def __init__(self, down: bool = False) -> None:
        self.values: dict[str, bytes] = {}
        self.down = down

    async def set(self, key: str, value: bytes, ex: int) -> None:
        if self.down:
            raise RedisConnectionError("down")
        self.values[key] = value

    async def get(self, key: str) -> bytes | None:
        if self.down:
            raise RedisConnectionError("down")
        return self.values.get(key)


def message(message_id: str, role: str) -> Message:
    return Message(id=message_id, role=role, content="x", status="complete", created_at=AT)


class Conversation:
    """Reads of a conversation whose reply is stored from the `stored_at`-th read on."""

    def __init__(self, stored_at: int) -> None:
        self.reads = 0
        self.stored_at = stored_at

    async def read(self) -> ConversationWithMessages:
        self.reads += 1
        messages = [message("m_1", "user")]
        if self.reads >= self.stored_at:
            messages.append(message("r_1", "assistant"))
        return ConversationWithMessages(
            id="c_1", model="m", title=None, created_at=AT, updated_at=AT, messages=messages
        )


def newest_reply(redis: MemoryRedis, wait_s: float = 5.0) -> NewestReply:
    return NewestReply(cast(aioredis.Redis, redis), wait_s)


async def test_the_next_turn_reads_again_until_the_reply_is_stored() -> None:
    newest = newest_reply(MemoryRedis())
    await newest.note("c_1", Newest("r_1", 1_000))
    conversation = Conversation(stored_at=3)
    opened, unstored = await newest.settled("c_1", conversation.read)
    assert [m.id for m in opened.messages] == ["m_1", "r_1"] and unstored is None
    assert conversation.reads == 3


async def test_past_the_wait_the_reply_is_named_by_the_key_it_will_be_stored_under() -> None:
    newest = newest_reply(MemoryRedis(), wait_s=0.2)
    await newest.note("c_1", Newest("r_1", 1_000))
    opened, unstored = await newest.settled("c_1", Conversation(stored_at=10_000).read)
    assert [m.id for m in opened.messages] == ["m_1"]
    assert unstored is not None and unstored.id == "r_1"
    final = FinalEvent(
        request_id="r_1",
        attempt=2,
        seq=3,
        finish_reason="stop",
        text="hi",
        usage=Usage(prompt_tokens=1, completion_tokens=1, queue_ms=0, decode_ms=0),
        model="m",
        user_id="u",
        tier="paid",
        conversation_id="c_1",
        created_at_ms=5_000,
        prompt_created_at_ms=1_000,
    )
    stored_at = dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(
        milliseconds=reply_time_ms(final)
    )
    assert unstored.created_at == stored_at  # the persistence consumer's clustering key


async def test_nothing_to_wait_for_without_a_noted_reply_or_without_redis() -> None:
    for redis in (MemoryRedis(), MemoryRedis(down=True)):
        newest = newest_reply(redis)
        await newest.note("c_2", Newest("r_2", 1_000))  # Redis down: not noted, no error
        conversation = Conversation(stored_at=10_000)
        _, unstored = await newest.settled("c_1", conversation.read)
        assert unstored is None and conversation.reads == 1
