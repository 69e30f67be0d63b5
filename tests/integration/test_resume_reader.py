"""A resumed stream reads its reply from the tokens partition, past other replies'
events (consumers/fanout.py `read_request`): in small fetches, so that a replica whose
streams all resume at once (another one drained) does not buffer a MiB for each, and
whole, even past a record larger than one fetch."""

from __future__ import annotations

import tracemalloc
import uuid

import pytest
from aiokafka import AIOKafkaProducer

from consumers.fanout import read_request
from schemas import topics
from schemas.codec import encode
from schemas.events import FinalEvent, TokenEvent
from tandoor.settings import Settings
from tests.unit.test_fanout_handback import final, token

pytestmark = pytest.mark.integration

PARTITION = 0


async def reply_around(producer: AIOKafkaProducer, others: list[TokenEvent]) -> tuple[str, int]:
    """A reply of two tokens and a final with `others` between its tokens; its request
    id and first offset."""
    rid = f"r_{uuid.uuid4().hex}"
    first = await producer.send_and_wait(
        topics.TOKENS, encode(token(0, rid)), key=rid.encode(), partition=PARTITION
    )
    for other in others:
        sent = await producer.send(topics.TOKENS, encode(other), key=b"other", partition=PARTITION)
    await sent
    ending = final(2).model_copy(update={"request_id": rid})
    for event in (token(1, rid), ending):
        await producer.send_and_wait(
            topics.TOKENS, encode(event), key=rid.encode(), partition=PARTITION
        )
    return rid, first.offset


def expected(rid: str) -> list[TokenEvent | FinalEvent]:
    return [token(0, rid), token(1, rid), final(2).model_copy(update={"request_id": rid})]


async def test_a_resumed_reply_holds_one_small_fetch_of_its_partition_at_a_time(
    producer: AIOKafkaProducer, settings: Settings
) -> None:
    other = token(0, "other").model_copy(update={"delta": "x" * 50_000})
    rid, offset = await reply_around(producer, [other] * 80)  # 4 MB of other replies
    tracemalloc.start()
    try:
        read = [item.event async for item in read_request(settings, rid, PARTITION, offset)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert read == expected(rid)
    assert peak < 1_500_000, f"{peak} bytes held"  # 1 MiB fetches: 2.3 MB; 256 KiB: 0.9


async def test_a_record_larger_than_a_fetch_is_read_past(
    producer: AIOKafkaProducer, settings: Settings
) -> None:
    huge = token(0, "other").model_copy(update={"delta": "x" * 600_000})
    rid, offset = await reply_around(producer, [huge])
    read = [item.event async for item in read_request(settings, rid, PARTITION, offset)]
    assert read == expected(rid)
