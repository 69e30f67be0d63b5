"""The collector of replies (`tandoor ask`, batch collection, tests and benchmarks)
reads all of `tokens`: a record it cannot decode belongs to someone else (a tombstone,
a newer schema mid-upgrade) and is passed over. It ended the reader, and every wait
then ran to its idle limit and reported that nothing arrived."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiokafka.structs import ConsumerRecord

from consumers.token_reader import TokenCollector
from schemas import topics
from schemas.codec import encode
from tandoor.settings import Settings
from tests.unit.test_rollups import final_event

WAIT_S = 10  # a failure guard only: everything here is in memory


async def records(*values: bytes | None) -> AsyncIterator[ConsumerRecord[bytes, bytes]]:
    for offset, value in enumerate(values):
        yield ConsumerRecord(topics.TOKENS, 0, offset, 0, 0, b"k", value, None, 0, 0, ())
    await asyncio.Event().wait()  # then nothing more, as a quiet topic


async def test_records_it_cannot_decode_are_passed_over() -> None:
    collector = TokenCollector(Settings())
    unstarted, collector._consumer = (
        collector._consumer,
        records(
            None, b'{"v": 99, "type": "final"}', b"\xff", encode(final_event("mine", attempt=1))
        ),
    )
    collector._task = asyncio.create_task(collector._read())
    try:
        final = await asyncio.wait_for(collector.final("mine", idle_s=WAIT_S), WAIT_S)
        assert final.text == "hi"
    finally:
        collector._task.cancel()
        await asyncio.gather(collector._task, return_exceptions=True)
        await unstarted.stop()


async def everyone_elses_traffic() -> AsyncIterator[ConsumerRecord[bytes, bytes]]:
    for offset in range(10**9):
        value = encode(final_event(f"other-{offset}", attempt=1))
        yield ConsumerRecord(topics.TOKENS, 0, offset, 0, 0, b"k", value, None, 0, 0, ())
        await asyncio.sleep(0.005)


async def test_a_collector_of_one_request_gives_up_while_others_replies_flow() -> None:
    """`tandoor ask` on a live stack whose worker never answers it: it waited for ever
    (any request's event counted as progress) and kept every event of the topic."""
    collector = TokenCollector(Settings(), only={"mine"})
    unstarted, collector._consumer = collector._consumer, everyone_elses_traffic()
    collector._task = asyncio.create_task(collector._read())
    try:
        with pytest.raises(TimeoutError, match="nothing arrived for 0 s waiting for mine"):
            await asyncio.wait_for(collector.final("mine", idle_s=0.3), WAIT_S)
        assert set(collector.events) <= {"mine"}, "kept the others' events"
    finally:
        collector._task.cancel()
        await asyncio.gather(collector._task, return_exceptions=True)
        await unstarted.stop()
