"""A running reply's in-flight record that Redis lost (restarted empty, or down when the
reply claimed its conversation) is written back by the gateway that runs the reply,
against the real Redis: stop finds it again, and a second reply cannot start beside it."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from consumers.fanout import Subscription
from producers.gateway.chat.inflight import InFlight, Queued
from producers.gateway.chat.keeper import keep_records
from producers.gateway.errors import ApiError
from schemas.events import now_ms
from tandoor.policies.redis_keys import attempt_key, final_key, inflight_key, lease_key
from tests.waiting import eventually

pytestmark = pytest.mark.integration


class Switchable:
    """The real client, or an unreachable one while `down` is set."""

    def __init__(self, real: aioredis.Redis) -> None:
        self.real = real
        self.down = False

    def __getattr__(self, name: str) -> Any:
        if self.down:
            raise RedisConnectionError("Redis is unreachable")
        return getattr(self.real, name)


def subscription() -> Subscription:
    return Subscription(request_id=f"r_{uuid.uuid4().hex}", partition=3, next_offset=7)


async def started(inflight: InFlight, sub: Subscription, start_by_ms: int | None = None) -> str:
    """A reply claimed and queued in a conversation of its own."""
    conversation_id = f"c_{uuid.uuid4().hex}"
    prompt = Queued("smollm2-135m", now_ms(), tier="free")
    start_by = now_ms() + 60_000 if start_by_ms is None else start_by_ms
    assert await inflight.claim(conversation_id, sub, start_by, prompt)
    await inflight.mark_queued(conversation_id, sub.request_id)
    return conversation_id


async def test_a_record_redis_lost_is_written_back_as_it_was(redis: aioredis.Redis) -> None:
    """Redis restarted empty mid-reply: stop answered 409 (no reply running), and a
    regenerate could start a second reply beside the first."""
    inflight, sub = InFlight(redis), subscription()
    conversation_id = await started(inflight, sub)
    before = await inflight.running(conversation_id, 409)
    await redis.delete(inflight_key(conversation_id))  # what a restart left
    assert await inflight.current(conversation_id) is None
    assert await inflight.rerecord() == 1
    assert await inflight.running(conversation_id, 409) == before
    assert before["queued"] and before["tier"] == "free"  # a stop may answer it itself
    assert await inflight.rerecord() == 0  # present: nothing to write


async def test_a_reply_claimed_while_redis_was_down_is_recorded_once_it_answers(
    redis: aioredis.Redis,
) -> None:
    client = Switchable(redis)
    inflight, sub = InFlight(client), subscription()  # type: ignore[arg-type]
    client.down = True
    conversation_id = await started(inflight, sub)  # it runs unrecorded
    client.down = False
    assert await inflight.current(conversation_id) is None
    assert await inflight.rerecord() == 1
    assert (await inflight.running(conversation_id, 409))["request_id"] == sub.request_id


async def test_a_reply_running_past_its_start_deadline_as_redis_restarted_is_still_running(
    redis: aioredis.Redis,
) -> None:
    """The restart took its attempt key too, and its worker takes back only its lease at
    its next event: the record written back read as a prompt nobody took in time, so a
    regenerate replaced it (a second reply beside the first), and a stop ended it with
    an empty cancelled final while it ran on."""
    inflight, sub = InFlight(redis), subscription()
    conversation_id = await started(inflight, sub, start_by_ms=now_ms() - 1)
    await redis.delete(inflight_key(conversation_id), attempt_key(sub.request_id))
    await redis.set(lease_key(sub.request_id), "worker-1", px=10_000)  # taken back
    assert await inflight.rerecord() == 1
    with pytest.raises(ApiError) as running:
        await inflight.ensure_idle(conversation_id)
    assert running.value.status == 409
    record = await inflight.running(conversation_id, 409)
    assert await inflight.end_untaken(record, "u_1", "free") is None
    assert await redis.get(final_key(sub.request_id)) is None


async def test_a_reply_queued_once_redis_answered_again_is_written_back_queued(
    redis: aioredis.Redis,
) -> None:
    """Down at the claim, back as the prompt was queued: the record written back said
    not queued, and a stop while the prompt waited in Kafka was not answered at once."""
    client = Switchable(redis)
    inflight, sub = InFlight(client), subscription()  # type: ignore[arg-type]
    conversation_id = f"c_{uuid.uuid4().hex}"
    client.down = True
    assert await inflight.claim(conversation_id, sub, now_ms() + 60_000, Queued("m", now_ms()))
    client.down = False
    await inflight.mark_queued(conversation_id, sub.request_id)
    assert await inflight.rerecord() == 1
    assert (await inflight.running(conversation_id, 409))["queued"]


async def test_only_running_replies_own_records_are_written_back(
    redis: aioredis.Redis,
) -> None:
    """An ended reply's record must not come back (its conversation would be a 409),
    nor may one overwrite the record of a reply another gateway runs there now."""
    inflight = InFlight(redis)
    ended = subscription()
    ended_in = await started(inflight, ended)
    await inflight.release(ended_in, ended.request_id)
    replaced = subscription()
    replaced_in = await started(inflight, replaced)
    others = b'{"request_id": "r_other"}'
    await redis.set(inflight_key(replaced_in), others, ex=60)
    assert await inflight.rerecord() == 0
    assert await inflight.current(ended_in) is None
    assert await redis.get(inflight_key(replaced_in)) == others


async def test_the_keeper_writes_lost_records_back_without_being_asked(
    redis: aioredis.Redis,
) -> None:
    inflight, sub = InFlight(redis), subscription()
    conversation_id = await started(inflight, sub)
    keeping = asyncio.create_task(keep_records(inflight, every_s=0.05))
    try:
        await redis.delete(inflight_key(conversation_id))
        back = await eventually(
            lambda: inflight.current(conversation_id), what="the record written back"
        )
        assert back is not None and back["request_id"] == sub.request_id
    finally:
        keeping.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keeping
