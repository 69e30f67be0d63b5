"""Admission's reading, with stand-ins for its consumer and reader (the real ones:
tests/integration/test_batch_admission.py and test_batch_topic_hostile.py).

Through a rebalance (members joining and leaving mid-batch): aiokafka reports the old
assignment until the new one is agreed, so the records of a batch read before a revoke
looked still ours. Taken after the revoke had forgotten their partition, they were
tracked for a partition gone to another member (whose commits Kafka then refused) or,
when it came back, taken twice (one of them never finished: no commit past it again)."""

from __future__ import annotations

from typing import Any, cast

from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord

from producers.admission.role import Admission
from schemas import topics
from tandoor.settings import Settings

TPS = {TopicPartition(topics.BATCH_REQUESTS, p) for p in (0, 1)}


class StandInConsumer:
    def __init__(self) -> None:
        self.commits: list[dict[TopicPartition, int]] = []

    def assignment(self) -> set[TopicPartition]:
        return TPS  # the old assignment, as until the rebalance completes

    def paused(self) -> set[TopicPartition]:
        return set()

    async def commit(self, offsets: dict[TopicPartition, int]) -> None:
        self.commits.append(offsets)


def record(partition: int, offset: int) -> ConsumerRecord[bytes, bytes]:
    return ConsumerRecord(
        topics.BATCH_REQUESTS, partition, offset, 0, 0, b"b", b"{}", None, 1, 2, [(b"h", b"v")]
    )


async def test_records_read_before_a_revoke_are_left_to_be_read_again() -> None:
    admission = Admission(Settings())
    batch = [record(0, 10), record(0, 11), record(1, 20)]

    class OneBatch:
        async def read(self, max_records: int, idle_s: float) -> list[Any]:
            admission.request_stop()  # one pass of the loop
            return batch

    admitted: list[int] = []

    async def admit(line: ConsumerRecord[bytes, bytes], read_in: int = 0) -> None:
        admitted.append(line.offset)
        if len(admitted) == 1:  # a member joins while the first line is checked
            await admission.on_partitions_revoked(list(TPS))

    await admission.consumer.stop()  # never started: closed for its finalizer
    consumer = StandInConsumer()
    admission.consumer = cast(Any, consumer)
    admission.reader = cast(Any, OneBatch())
    admission._admit = admit  # type: ignore[method-assign,assignment]
    try:
        await admission._read_lines()
    finally:
        await admission.producer.stop()  # never started: closed for its finalizer
    assert admitted == [10]
    assert admission.offsets.to_commit() == {}, "the rest is the next owner's to read"


async def test_an_unreadable_last_record_dead_lettered_is_committed_past() -> None:
    """It was never marked handled: as the partition's last record, the commit stayed
    below it, and every restart read it and dead-lettered it again."""
    admission = Admission(Settings())
    tp = TopicPartition(topics.BATCH_REQUESTS, 0)
    letters: list[Any] = []

    class StandInProducer:
        async def send_and_wait(self, topic: str, value: bytes, **kwargs: Any) -> None:
            letters.append(dict(kwargs["headers"]))

    class SteppingOver:
        async def read(self, max_records: int, idle_s: float) -> list[Any]:
            admission.request_stop()
            await admission._unreadable(tp, 5, "a header name that is not UTF-8")
            return []

    await admission.consumer.stop()  # never started: closed for their finalizers
    await admission.producer.stop()
    admission.consumer = cast(Any, StandInConsumer())
    admission.producer = cast(Any, StandInProducer())
    admission.reader = cast(Any, SteppingOver())
    await admission._read_lines()
    assert len(letters) == 1
    assert admission.offsets.to_commit() == {(topics.BATCH_REQUESTS, 0): 6}
