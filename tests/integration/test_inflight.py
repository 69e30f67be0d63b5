"""The in-flight record against the real Redis: a stop that reaches a prompt no worker
has taken yet answers it itself, from the record alone (any gateway can be the one
that stops: the one that queued the prompt may be gone)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis.asyncio as aioredis

from consumers.fanout import Subscription
from consumers.history import HistoryWriter
from producers.gateway.chat.inflight import InFlight, Queued, StoredReply
from producers.gateway.chat.settled import reply_stored
from producers.gateway.conversations.service import ConversationService
from producers.gateway.errors import ApiError
from schemas.codec import decode
from schemas.events import FinalEvent, MessageKey, now_ms
from tandoor.policies.redis_keys import attempt_key, done_key, final_key
from tests.integration.persisting import final

pytestmark = pytest.mark.integration

OLD_REPLIES = [
    MessageKey(created_at_ms=1_000, message_id="r_old"),
    MessageKey(created_at_ms=2_000, message_id="r_older_edit"),
]


async def claimed(
    redis: aioredis.Redis,
    replaces: list[MessageKey],
    queued: bool = True,
    store: bool = True,
    prompt_at_ms: int | None = None,
    stored: StoredReply | None = None,
) -> tuple[InFlight, str]:
    inflight, conversation_id = InFlight(redis, stored), f"c_{uuid.uuid4().hex}"
    sub = Subscription(request_id=f"r_{uuid.uuid4().hex}", partition=3, next_offset=7)
    prompt = Queued("smollm2-135m", prompt_at_ms or now_ms(), replaces, store=store)
    assert await inflight.claim(conversation_id, sub, now_ms() + 60_000, prompt)
    if queued:  # the gateway produced the prompt
        await inflight.mark_queued(conversation_id, sub.request_id)
    return inflight, conversation_id


async def test_a_stop_before_the_prompt_is_queued_ends_nothing_itself(
    redis: aioredis.Redis,
) -> None:
    """The record is written before the quota, the message's write and the produce: a
    stop then published a cancelled final, and when the regenerate was refused after
    all (a 429, a 413) the conversation had an empty stopped reply in place of the one
    the refused regenerate was to replace."""
    inflight, conversation_id = await claimed(redis, OLD_REPLIES, queued=False)
    record = await inflight.running(conversation_id, 409)
    assert await inflight.end_untaken(record, "u_1", "free") is None
    assert await redis.get(final_key(record["request_id"])) is None
    await inflight.mark_queued(conversation_id, record["request_id"])
    queued = await inflight.running(conversation_id, 409)
    assert await inflight.end_untaken(queued, "u_1", "free") is not None


async def test_a_stop_before_any_worker_ends_a_regenerate_with_what_it_replaces(
    redis: aioredis.Redis,
) -> None:
    """Its cancelled final names the replies the regenerate replaces, so persistence
    hides them as it stores the stopped reply, and so does the final a worker delivers
    again later (kept in Redis)."""
    inflight, conversation_id = await claimed(redis, OLD_REPLIES)
    record = await inflight.running(conversation_id, 409)  # as another gateway reads it
    final = await inflight.end_untaken(record, "u_1", "free")
    assert final is not None
    assert (final.request_id, final.finish_reason, final.text) == (
        record["request_id"],
        "cancelled",
        "",
    )
    assert final.conversation_id == conversation_id
    assert final.replaces == OLD_REPLIES
    kept = await redis.get(final_key(final.request_id))
    assert kept is not None and decode(FinalEvent, kept).replaces == OLD_REPLIES
    assert await inflight.end_untaken(record, "u_1", "free") is None  # a second stop


@pytest.mark.parametrize("store", [False, True])
async def test_a_reply_ended_in_the_queue_is_stored_only_if_asked(
    redis: aioredis.Redis, store: bool
) -> None:
    """OpenAI's `store: false`, its client gone while the prompt waited: the cancelled
    final said store, and persistence kept a stopped reply in a conversation nobody
    asked to keep (and again when the worker delivered that final later)."""
    inflight, conversation_id = await claimed(redis, [], store=store)
    record = await inflight.running(conversation_id, 409)
    final = await inflight.end_untaken(record, "u_1", "free")
    assert final is not None and final.store is store
    kept = await redis.get(final_key(final.request_id))
    assert kept is not None and decode(FinalEvent, kept).store is store


async def test_a_stop_after_a_worker_took_the_prompt_leaves_the_final_to_it(
    redis: aioredis.Redis,
) -> None:
    inflight, conversation_id = await claimed(redis, [])
    record = await inflight.running(conversation_id, 409)
    await redis.set(attempt_key(record["request_id"]), 1, ex=60)
    assert await inflight.end_untaken(record, "u_1", "free") is None
    assert await redis.get(final_key(record["request_id"])) is None


async def test_a_stop_on_a_gateway_whose_clock_is_behind_ends_the_queued_prompt(
    redis: aioredis.Redis,
) -> None:
    """The prompt was queued by a gateway a minute ahead: the final's queue time came
    out negative, its validation failed, and Stop (and DELETE) answered 500."""
    inflight, conversation_id = await claimed(redis, [], prompt_at_ms=now_ms() + 60_000)
    record = await inflight.running(conversation_id, 409)
    final = await inflight.end_untaken(record, "u_1", "free")
    assert final is not None and final.finish_reason == "cancelled"
    assert final.usage.queue_ms == 0 and final.created_at_ms >= record["prompt_at_ms"]


async def test_a_reply_ending_releases_only_its_own_record(redis: aioredis.Redis) -> None:
    """Its end released the record after the next reply had claimed it (it judged the
    ended one stale): the next reply then ran unrecorded, unstoppable, and a third post
    was let in beside it. Read and deleted in one step now."""
    inflight, conversation_id = await claimed(redis, [])
    ended = await inflight.running(conversation_id, 409)
    await redis.set(done_key(ended["request_id"]), 1, ex=60)  # its worker finished it
    following = Subscription(request_id=f"r_{uuid.uuid4().hex}", partition=3, next_offset=9)
    prompt = Queued("smollm2-135m", now_ms())
    assert await inflight.claim(conversation_id, following, now_ms() + 60_000, prompt)
    await inflight.release(conversation_id, ended["request_id"])
    assert (await inflight.running(conversation_id, 409))["request_id"] == following.request_id
    await inflight.release(conversation_id, following.request_id)
    assert await inflight.current(conversation_id) is None


async def test_a_reply_stored_frees_its_conversation_though_redis_missed_its_end(
    redis: aioredis.Redis, session: Any
) -> None:
    """Redis unreachable as the reply ended: neither its worker's done mark nor the
    gateway's release was written. Redis back with its data, the record stood, not
    stale (its worker had taken it): every post to the chat was a 409 for an hour."""
    stored = reply_stored(ConversationService(session, ["smollm2"]))
    inflight, conversation_id = await claimed(redis, [], stored=stored)
    record = await inflight.running(conversation_id, 409)
    await redis.set(attempt_key(record["request_id"]), 1, ex=60)  # a worker took it
    with pytest.raises(ApiError) as running:
        await inflight.ensure_idle(conversation_id)
    assert running.value.status == 409
    ended = final(
        conversation_id, "Done.", request_id=record["request_id"], prompt_at=record["prompt_at_ms"]
    )
    await HistoryWriter(session).store(ended)  # persistence stored its final
    await inflight.ensure_idle(conversation_id)
    following = Subscription(request_id=f"r_{uuid.uuid4().hex}", partition=3, next_offset=9)
    assert await inflight.claim(conversation_id, following, now_ms() + 60_000, Queued("m", 1))
