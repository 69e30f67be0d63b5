"""PartitionReader against a stand-in consumer (the real one: test_batch_topic_hostile.py):
what it read before a failure is read again, never dropped, and an unreadable record
is stepped over with the records before it kept."""

from __future__ import annotations

from typing import Any

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import KafkaConnectionError
from aiokafka.structs import ConsumerRecord

from tandoor.partition_reader import PartitionReader

TOPIC = "batch.requests"
ONE, TWO = TopicPartition(TOPIC, 1), TopicPartition(TOPIC, 2)
BAD = UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")


def record(tp: TopicPartition, offset: int) -> ConsumerRecord[bytes, bytes]:
    return ConsumerRecord(tp.topic, tp.partition, offset, 0, 0, None, b"{}", None, 0, 2, [])


class Consumer:
    """Partitions as lists of offsets; an offset in `unreadable` raises as aiokafka does."""

    def __init__(self, logs: dict[TopicPartition, int], unreadable: frozenset[int] = frozenset()):
        self.ends = logs
        self.positions = dict.fromkeys(logs, 0)
        self.unreadable = set(unreadable)
        self.failing: set[TopicPartition] = set()

    def assignment(self) -> set[TopicPartition]:
        return set(self.ends)

    def paused(self) -> set[TopicPartition]:
        return set()

    async def getmany(self, tp: TopicPartition, **limits: Any) -> dict[Any, list[Any]]:
        if tp in self.failing:
            raise KafkaConnectionError()
        start = self.positions[tp]
        offsets = range(start, min(self.ends[tp], start + limits["max_records"]))
        if self.unreadable & set(offsets):
            raise BAD  # and, as aiokafka, returns none of the call's records
        self.positions[tp] += len(offsets)
        return {tp: [record(tp, offset) for offset in offsets]} if offsets else {}

    async def position(self, tp: TopicPartition) -> int:
        return self.positions[tp]

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.positions[tp] = offset


async def test_an_unreadable_record_is_skipped_and_reported_and_the_rest_are_read() -> None:
    consumer = Consumer({ONE: 5, TWO: 2}, unreadable=frozenset({3}))
    reported: list[tuple[TopicPartition, int]] = []

    async def report(tp: TopicPartition, offset: int, reason: str) -> None:
        reported.append((tp, offset))

    reader = PartitionReader(consumer, report)
    first = await reader.read(max_records=100, idle_s=0)
    assert [(r.partition, r.offset) for r in first] == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1)]
    assert reported == [(ONE, 3)]
    rest = await reader.read(max_records=100, idle_s=0)
    assert [(r.partition, r.offset) for r in rest] == [(1, 4)]


async def test_records_read_before_a_failing_partition_are_read_again() -> None:
    consumer = Consumer({ONE: 3, TWO: 3})
    consumer.failing.add(TWO)
    reader = PartitionReader(consumer, lambda *_: None)  # type: ignore[arg-type]
    with pytest.raises(KafkaConnectionError):
        await reader.read(max_records=100, idle_s=0)
    consumer.failing.clear()
    again = await reader.read(max_records=100, idle_s=0)
    offsets = sorted((r.partition, r.offset) for r in again)  # from either, in turn
    assert offsets == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]


async def test_a_flooded_partition_does_not_starve_the_others() -> None:
    """Read from the lowest partition first, a million lines on it (refused as read, so
    never paused) took every read, and the other partitions' new batches did not move."""
    others = [TopicPartition(TOPIC, n) for n in range(1, 8)]
    consumer = Consumer({TopicPartition(TOPIC, 0): 1_000_000} | dict.fromkeys(others, 100))
    reader = PartitionReader(consumer, lambda *_: None)  # type: ignore[arg-type]
    read: dict[int, int] = {}
    for _ in range(8):
        for r in await reader.read(max_records=500, idle_s=0):
            read[r.partition] = read.get(r.partition, 0) + 1
    assert all(read.get(tp.partition, 0) == 100 for tp in others), read
