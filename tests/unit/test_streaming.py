"""Stream slots and the write timeout that cuts off a client which stopped reading."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import pytest
from starlette.types import Message

from producers.gateway.errors import ApiError
from producers.gateway.streaming import DRAINED, ReplyStream, StreamSlots

SCOPE = {"type": "http", "asgi": {"spec_version": "2.3"}, "client": ("127.0.0.1", 5)}


@contextmanager
def gc_off() -> Iterator[None]:
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def endless() -> AsyncIterator[str]:
    while True:
        yield "data: {}\n\n"
        await asyncio.sleep(0)


async def never_disconnects() -> Message:
    await asyncio.Event().wait()
    return {"type": "http.disconnect"}


def test_slots_are_capped_and_given_back_once() -> None:
    slots = StreamSlots(limit=2)
    first, _ = slots.take(), slots.take()
    with pytest.raises(ApiError) as refused:
        slots.take()
    assert refused.value.status == 503 and refused.value.headers["Retry-After"]
    first.release()
    first.release()
    assert slots.open == 1


def test_each_users_resumes_are_capped_and_given_back() -> None:
    """A resume is charged nothing: one user's resumes filled the replica's slots."""
    slots = StreamSlots(limit=10, resumes_per_user=2)
    first, _ = slots.take(resumed_by="u"), slots.take(resumed_by="u")
    with pytest.raises(ApiError) as refused:
        slots.take(resumed_by="u")
    assert refused.value.status == 429 and refused.value.headers["Retry-After"]
    slots.take(resumed_by="v")  # another user's, and posts, are not held back
    slots.take()
    first.release()
    first.release()
    slots.take(resumed_by="u")
    assert slots.open == 4 and slots.resumed == {"u": 2, "v": 1}


def test_a_failed_start_gives_the_slot_back() -> None:
    slots = StreamSlots(limit=1)
    with pytest.raises(RuntimeError), slots.reserve():
        raise RuntimeError("quota")
    assert slots.open == 0


async def test_a_client_that_stops_reading_is_cut_off_and_its_slot_freed() -> None:
    slots = StreamSlots(limit=1)
    written: list[Message] = []

    async def stuck_after_three(message: Message) -> None:
        written.append(message)
        if len(written) > 3:
            await asyncio.Event().wait()  # the socket buffer is full and never drains

    stream = ReplyStream(endless(), slots.take(), write_timeout_s=0.2, headers={})
    await asyncio.wait_for(stream(SCOPE, never_disconnects, stuck_after_three), 5)
    assert len(written) == 4 and slots.open == 0


async def test_frames_of_waiting_events_go_out_in_one_write() -> None:
    """Frames made while more events wait are written together; the last of a run, and
    every frame of a reply whose events come one by one, at once."""
    waiting = [True, True, False, False, True, False]  # after each frame: more queued?

    async def frames() -> AsyncIterator[str]:
        for i in range(len(waiting)):
            yield f"data: {i}\n\n"

    bodies: list[bytes] = []

    async def record(message: Message) -> None:
        if message["type"] == "http.response.body":
            bodies.append(message["body"])

    queued = iter(waiting)
    stream = ReplyStream(
        frames(), StreamSlots(1).take(), 5, {}, resumable=False, queued=lambda: next(queued)
    )
    await stream(SCOPE, never_disconnects, record)
    assert bodies == [
        b"data: 0\n\ndata: 1\n\ndata: 2\n\n",
        b"data: 3\n\n",
        b"data: 4\n\ndata: 5\n\n",
        b"",
    ]


async def test_events_that_make_no_frame_still_send_keepalives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Text the redaction holds (a count to 400: 1,490 of 1,497 characters) comes as
    empty chunks: nothing was written, and no keep-alive either (they were sent only
    when no event came), so a proxy's idle limit cut the stream."""
    monkeypatch.setattr("producers.gateway.streaming.KEEPALIVE_S", 0.05)

    async def held() -> AsyncIterator[str]:
        for _ in range(30):  # an event every 10 ms, each held back
            yield ""
            await asyncio.sleep(0.01)
        yield "data: 1 2 3\n\n"

    bodies: list[bytes] = []

    async def record(message: Message) -> None:
        if message["type"] == "http.response.body":
            bodies.append(message["body"])

    stream = ReplyStream(held(), StreamSlots(1).take(), 5, {}, resumable=False)
    await stream(SCOPE, never_disconnects, record)
    keepalives = [body for body in bodies if body.startswith(b":")]
    assert len(keepalives) >= 2 and bodies[-2:] == [b"data: 1 2 3\n\n", b""]


@pytest.mark.parametrize("end_is_in", [True, False])
async def test_a_drain_lets_a_reply_whose_end_is_in_finish(end_is_in: bool) -> None:
    """The end came and was being settled (its record released: a resume is a 404)
    when the replica began to drain: the stream was cut, and the reply's last word,
    held back for redaction until the end, never reached the page. A reply still
    running is cut (its client resumes elsewhere)."""
    slots, ending, asked = StreamSlots(1), False, asyncio.Event()

    async def frames() -> AsyncIterator[str]:
        nonlocal ending
        yield "data: token\n\n"
        ending = end_is_in
        slots.draining.set()  # SIGTERM, while the end is settled
        await asked.wait()  # the stream has seen the drain (and cuts this, or waits)
        if not ending:
            await asyncio.Event().wait()  # a reply still running: more to come, until cut
        yield "data: final\n\n"
        yield "data: [DONE]\n\n"

    bodies: list[bytes] = []

    async def record(message: Message) -> None:
        if message["type"] == "http.response.body":
            bodies.append(message["body"])

    def ask() -> bool:
        asked.set()
        return ending

    stream = ReplyStream(frames(), slots.take(), 5, {}, ending=ask)
    await stream(SCOPE, never_disconnects, record)
    written = b"".join(bodies)
    if end_is_in:
        assert written.endswith(b"data: final\n\ndata: [DONE]\n\n") and DRAINED not in written
    else:
        assert written == b"data: token\n\n" + DRAINED


@pytest.mark.parametrize("cut_by", ["drain", "slow client"])
async def test_a_body_cut_short_at_a_frame_is_closed(cut_by: str) -> None:
    """A body cut while its frame was being written waits at that frame for good: what
    it holds (a resumed reply's Kafka reader) stayed open until the garbage collector
    found it, long after, where a reference cycle kept it."""
    slots, closed = StreamSlots(1), asyncio.Event()

    async def frames() -> AsyncIterator[str]:
        try:
            while True:
                yield "data: token\n\n"
        finally:
            closed.set()

    async def stuck(message: Message) -> None:
        if message["type"] == "http.response.body":
            if cut_by == "drain":
                slots.draining.set()
            await asyncio.Event().wait()  # the socket buffer is full and never drains

    async def sent(message: Message) -> None:
        if not message.get("body", b"").startswith(DRAINED):
            await stuck(message)

    body = frames()
    with gc_off():
        stream = ReplyStream(body, slots.take(), write_timeout_s=0.2, headers={})
        await asyncio.wait_for(stream(SCOPE, never_disconnects, sent), 5)
        assert closed.is_set() and slots.open == 0


async def test_a_drain_does_not_wait_on_a_client_that_stopped_reading() -> None:
    """The drain's closing comment was written without the write timeout: a client that
    had stopped reading held the request, and the replica's drain, until uvicorn gave
    up on it."""
    slots, blocked = StreamSlots(1), asyncio.Event()

    async def frames() -> AsyncIterator[str]:
        yield "data: token\n\n"
        await blocked.wait()
        slots.draining.set()  # SIGTERM, while the socket's buffer is full
        await asyncio.Event().wait()

    async def full_after_the_first(message: Message) -> None:
        if message["type"] == "http.response.body" and blocked.is_set():
            await asyncio.Event().wait()  # never drains
        if message["type"] == "http.response.body":
            blocked.set()

    stream = ReplyStream(frames(), slots.take(), write_timeout_s=0.2, headers={})
    await asyncio.wait_for(stream(SCOPE, never_disconnects, full_after_the_first), 5)
    assert slots.open == 0
