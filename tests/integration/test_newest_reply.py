"""The next turn's wait for the newest reply to be stored (producers/gateway/chat/newest.py),
against the real Redis and a conversation whose reply lands after some probes."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest
import redis.asyncio as aioredis
from cassandra import OperationTimedOut

from consumers.history import reply_time_ms
from infra.process import free_port
from producers.gateway.chat.newest import Newest, NewestReply
from producers.gateway.conversations.protocol import ConversationWithMessages, Message
from schemas.events import FinalEvent, Usage
from tandoor.clients import redis_client
from tandoor.settings import Settings

pytestmark = pytest.mark.integration

AT = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)


class Conversation:
    """A conversation whose reply `r_1` is stored from the `stored_at`-th probe on."""

    def __init__(self, stored_at: int) -> None:
        self.reads = self.probes = 0
        self.stored_at = stored_at

    async def read(self) -> ConversationWithMessages:
        self.reads += 1
        messages = [Message(id="m_1", role="user", content="hi", status="sent", created_at=AT)]
        if self.probes >= self.stored_at:
            messages.append(
                Message(id="r_1", role="assistant", content="x", status="complete", created_at=AT)
            )
        return ConversationWithMessages(
            id="c", model="m", title=None, created_at=AT, updated_at=AT, messages=messages
        )

    async def stored(self, newest: Newest) -> bool:
        self.probes += 1
        return self.probes >= self.stored_at


async def test_the_next_turn_probes_until_the_reply_is_stored(redis: aioredis.Redis) -> None:
    newest, conversation_id = NewestReply(redis), f"c_{uuid.uuid4().hex}"
    await newest.note(conversation_id, Newest("r_1", 1_000))
    conversation = Conversation(stored_at=3)
    opened, unstored = await newest.settled(conversation_id, conversation.read, conversation.stored)
    assert [m.id for m in opened.messages] == ["m_1", "r_1"] and unstored is None
    assert (conversation.probes, conversation.reads) == (3, 2)  # the whole read: twice


async def test_an_older_reply_noted_late_does_not_hide_the_newer(redis: aioredis.Redis) -> None:
    newest, conversation_id = NewestReply(redis, wait_s=0.1), f"c_{uuid.uuid4().hex}"
    await newest.note(conversation_id, Newest("r_2", 2_000))
    await newest.note(conversation_id, Newest("r_1", 1_000))  # a slow gateway's
    _, unstored = await newest.settled(
        conversation_id, Conversation(10**6).read, Conversation(10**6).stored
    )
    assert unstored is not None and unstored.id == "r_2"


async def test_past_the_wait_the_reply_is_named_by_the_key_it_will_be_stored_under(
    redis: aioredis.Redis,
) -> None:
    newest, conversation_id = NewestReply(redis, wait_s=0.2), f"c_{uuid.uuid4().hex}"
    await newest.note(conversation_id, Newest("r_1", 1_000))
    opened, unstored = await newest.settled(
        conversation_id, Conversation(10**6).read, Conversation(10**6).stored
    )
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
        tier="plus",
        conversation_id=conversation_id,
        created_at_ms=5_000,
        prompt_created_at_ms=1_000,
    )
    epoch = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
    # The persistence consumer's clustering key for the reply.
    assert unstored.created_at == epoch + dt.timedelta(milliseconds=reply_time_ms(final))


async def test_a_failing_probe_or_redis_down_costs_no_wait_and_no_error(
    settings: Settings, redis: aioredis.Redis
) -> None:
    newest, conversation_id = NewestReply(redis), f"c_{uuid.uuid4().hex}"
    await newest.note(conversation_id, Newest("r_1", 1_000))

    probes = []

    async def timing_out(probed: Newest) -> bool:
        probes.append(probed)
        raise OperationTimedOut("probe")

    _, unstored = await newest.settled(conversation_id, Conversation(10**6).read, timing_out)
    assert unstored is not None and len(probes) == 1  # on at the first failed probe
    down = redis_client(settings.model_copy(update={"redis_port": free_port()}))
    try:
        conversation = Conversation(10**6)
        await NewestReply(down).note(conversation_id, Newest("r_2", 2_000))
        _, unstored = await NewestReply(down).settled(
            conversation_id, conversation.read, conversation.stored
        )
        assert unstored is None and conversation.probes == 0
    finally:
        await down.aclose()
