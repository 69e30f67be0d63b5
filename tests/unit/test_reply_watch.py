"""ReplyWatch hands a reply's end to its client only once the reply is settled (stream
slot freed, conversation idle), so a client that asks again at once is not refused; a
settlement that hangs delays the end by SETTLE_WAIT_S at most."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from consumers.fanout import Delivered, Subscription
from producers.gateway.chat import watch
from producers.gateway.chat.watch import ReplyWatch, with_keepalives
from schemas.events import FinalEvent, TokenEvent, Usage


def token(seq: int) -> Delivered:
    event = TokenEvent(
        request_id="r-1", attempt=1, seq=seq, delta="hi", token_count=1, created_at_ms=1
    )
    return Delivered(0, seq, event)


def final() -> Delivered:
    usage = Usage(prompt_tokens=5, completion_tokens=1, queue_ms=0, decode_ms=0)
    event = FinalEvent(
        request_id="r-1",
        attempt=1,
        seq=1,
        finish_reason="stop",
        text="hi",
        usage=usage,
        model="smollm2",
        user_id="alice",
        tier="plus",
        conversation_id="c-1",
        created_at_ms=1,
    )
    return Delivered(0, 1, event)


async def read_all(reply: ReplyWatch, seen: list[str]) -> None:
    async for item in reply.events():
        if item is not None:
            seen.append(type(item.event).__name__)
    seen.append("end")


async def test_the_end_reaches_the_client_after_the_reply_is_settled() -> None:
    settling, settled, seen = asyncio.Event(), asyncio.Event(), []

    async def on_final(event: FinalEvent | None) -> None:
        assert event is not None and event.text == "hi"
        settling.set()
        await settled.wait()
        seen.append("settled")

    sub = Subscription("r-1", 0, 0)
    reply = ReplyWatch(sub, give_up_s=60, on_final=on_final)
    sub.push(token(0))
    sub.push(final())
    client = asyncio.create_task(read_all(reply, seen))
    await settling.wait()
    for _ in range(50):  # every ready task has its turns: the client reads all it is given
        await asyncio.sleep(0)
    assert seen == ["TokenEvent"], "the end went out before the reply was settled"
    settled.set()
    await asyncio.wait_for(client, 5)
    assert seen == ["TokenEvent", "settled", "FinalEvent", "end"]
    await reply.task


async def test_a_hung_settlement_delays_the_end_by_a_bounded_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(watch, "SETTLE_WAIT_S", 0.05)
    settled, seen = asyncio.Event(), []

    async def on_final(event: FinalEvent | None) -> None:
        await settled.wait()
        seen.append("settled")

    sub = Subscription("r-1", 0, 0)
    reply = ReplyWatch(sub, give_up_s=60, on_final=on_final)
    sub.push(final())
    await asyncio.wait_for(read_all(reply, seen), 5)
    assert seen == ["FinalEvent", "end"]
    settled.set()  # and the settling still completes behind it
    await asyncio.wait_for(reply.task, 5)
    assert seen[-1] == "settled"


async def test_a_resumed_stream_keeps_alive_then_ends_and_closes_its_reader() -> None:
    """A reply read back from Kafka whose worker is gone: keep-alives while it is quiet,
    the end after the give-up time, and the reader (a Kafka consumer) closed."""
    closed = asyncio.Event()

    async def reader() -> AsyncIterator[int]:
        try:
            yield 1
            await asyncio.Event().wait()  # nothing more will come
            yield 2
        finally:
            closed.set()

    got = [item async for item in with_keepalives(reader(), keepalive_s=0.01, give_up_s=0.05)]
    assert got[0] == 1 and set(got[1:]) == {None} and 3 <= len(got[1:]) <= 5, got
    assert closed.is_set()


async def test_a_resumed_stream_passes_every_event_and_ends_with_its_reader() -> None:
    async def reader() -> AsyncIterator[int]:
        for n in range(3):
            await asyncio.sleep(0.03)  # longer than a keep-alive
            yield n

    got = [item async for item in with_keepalives(reader(), keepalive_s=0.01, give_up_s=1)]
    assert [n for n in got if n is not None] == [0, 1, 2] and None in got
