"""A resumed reply's Kafka reader closes with its stream, however the stream ends,
without the garbage collector (stand-ins for the in-flight record, the quotas and the
reader): left to it, a gateway kept three readers fetching long after their streams."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, cast

import pytest
from aiokafka.errors import KafkaConnectionError

import consumers.fanout as fanout
from consumers.fanout import Delivered, ReaderCount
from producers.gateway.chat.control import ReplyControl
from producers.gateway.chat.router import resumed_frames
from schemas.events import FinalEvent
from tandoor.policies.api_keys import Principal
from tandoor.policies.moderation import StreamRedactor
from tandoor.settings import Settings
from tests.unit.test_fanout_handback import REQUEST, record
from tests.unit.test_fanout_handback import final as handback_final
from tests.unit.test_fanout_handback import token as handback_token
from tests.unit.test_resume_slot import Released
from tests.unit.test_sse import final, token
from tests.unit.test_streaming import gc_off
from tests.waiting import until

RECORD = {"request_id": "r", "partition": 0, "offset": 0}


class Running(Released):
    """The in-flight record of a reply that runs, in a conversation the caller owns."""

    async def owned(self, *_: Any) -> None:
        return None

    async def running(self, *_: Any) -> dict[str, Any]:
        return RECORD

    async def abandoned(self, *_: Any) -> bool:
        return False


@pytest.fixture
def readers(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What each reader did: "open", then "closed" once its `finally` ran."""
    done: list[str] = []

    async def read_request(*_: Any) -> AsyncIterator[Delivered]:
        done.append("open")
        try:
            for offset, event in enumerate([token("Hi", 0), token(" there", 1)]):
                yield Delivered(0, offset, event)
            yield Delivered(0, 2, final("Hi there"))
            yield Delivered(0, 3, token("never read: the final ended the stream", 2))
        finally:
            done.append("closed")

    monkeypatch.setattr("producers.gateway.chat.control.read_request", read_request)
    return done


async def resumed_stream() -> AsyncGenerator[str, None]:
    running = Running()
    stand_in = cast(Any, running)
    control = ReplyControl(Settings(), stand_in, stand_in, stand_in, stand_in)
    resumed = await control.resume(Principal("u", "free", "k"), "c")
    return resumed_frames("start", resumed, StreamRedactor, None)


async def test_a_resume_read_to_its_final_closes_its_reader(readers: list[str]) -> None:
    with gc_off():
        frames = [chunk async for chunk in await resumed_stream()]
    assert frames[0] == "start" and "[DONE]" in frames[-1]
    assert readers == ["open", "closed"]


async def test_a_resume_closed_midway_closes_its_reader(readers: list[str]) -> None:
    with gc_off():
        frames = await resumed_stream()
        assert await anext(frames) == "start"
        await anext(frames)  # the reply's first event: its first word, held by the redaction
        await frames.aclose()
    assert readers == ["open", "closed"]


class Connecting:
    """A Kafka consumer still connecting (the broker slow to answer) when its client left."""

    started = asyncio.Event()
    stopped = 0

    def __init__(self, **_: Any) -> None:
        pass

    async def start(self) -> None:
        Connecting.started.set()
        await asyncio.Event().wait()

    async def stop(self) -> None:
        Connecting.stopped += 1


async def test_a_reader_whose_client_left_while_it_connected_is_stopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its start was outside the cleanup: the bootstrap connection stayed open."""
    monkeypatch.setattr(fanout, "AIOKafkaConsumer", Connecting)
    monkeypatch.setattr(Connecting, "started", asyncio.Event())
    monkeypatch.setattr(Connecting, "stopped", 0)
    before = ReaderCount.open
    reading = asyncio.ensure_future(anext(fanout.read_request(Settings(), "r", 0, 0)))
    await asyncio.wait_for(Connecting.started.wait(), 10)
    reading.cancel()
    await asyncio.gather(reading, return_exceptions=True)
    assert Connecting.stopped == 1 and ReaderCount.open == before


class SlowToStop:
    """A consumer whose stop takes a while (its coordinator's close, its connections)."""

    reading = asyncio.Event()
    stopping = asyncio.Event()
    may_finish = asyncio.Event()
    stopped = 0

    def __init__(self, **_: Any) -> None:
        pass

    async def start(self) -> None:
        pass

    def assign(self, _: Any) -> None:
        pass

    def seek(self, *_: Any) -> None:
        pass

    def __aiter__(self) -> SlowToStop:
        return self

    async def __anext__(self) -> Any:
        SlowToStop.reading.set()
        await asyncio.Event().wait()  # no event for this request yet

    async def stop(self) -> None:
        SlowToStop.stopping.set()
        await SlowToStop.may_finish.wait()
        SlowToStop.stopped += 1


async def test_a_reader_cancelled_again_while_it_stops_still_stops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Starlette cancels a stream whose client left again and again (anyio's cancel
    scope) until it ends: the second cancel cut the consumer's stop short, its fetcher
    and connections left running, while the readers metric counted it closed."""
    monkeypatch.setattr(fanout, "AIOKafkaConsumer", SlowToStop)
    for name in ("reading", "stopping", "may_finish"):
        monkeypatch.setattr(SlowToStop, name, asyncio.Event())
    monkeypatch.setattr(SlowToStop, "stopped", 0)
    before = ReaderCount.open
    reading = asyncio.ensure_future(anext(fanout.read_request(Settings(), "r", 0, 0)))
    await asyncio.wait_for(SlowToStop.reading.wait(), 10)
    reading.cancel()
    await asyncio.wait_for(SlowToStop.stopping.wait(), 10)
    reading.cancel()  # again, while it stops
    await asyncio.gather(reading, return_exceptions=True)
    assert ReaderCount.open == before + 1  # not stopped yet: still counted
    SlowToStop.may_finish.set()
    await until(lambda: SlowToStop.stopped, what="the reader's stop", idle_s=10)
    assert ReaderCount.open == before


async def test_a_resume_while_kafka_is_unreachable_reads_on_once_it_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The reader's start failing (KafkaConnectionError) ended the stream with a
    traceback, its start frame sent; now it is tried again, from past what was read."""
    started_at: list[int] = []
    lost = KafkaConnectionError("Unable to bootstrap from [('127.0.0.1', 19092)]")

    @contextlib.asynccontextmanager
    async def reader(_: object, partition: int, offset: int) -> AsyncIterator[Any]:
        started_at.append(offset)
        if len(started_at) == 1:
            raise lost

        async def records() -> AsyncIterator[Any]:
            if len(started_at) == 2:  # two events, then the connection drops
                yield record(0, handback_token(0))
                yield record(1, handback_token(1))
                raise lost
            yield record(2, handback_final(2))

        yield records()

    monkeypatch.setattr(fanout, "partition_reader", reader)
    monkeypatch.setattr(fanout, "READER_RETRY_S", 0)
    read = [item async for item in fanout.read_request(Settings(), REQUEST, 0, 0)]
    assert [item.offset for item in read] == [0, 1, 2]
    assert isinstance(read[-1].event, FinalEvent)
    assert started_at == [0, 0, 2]
