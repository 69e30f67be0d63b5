"""A worker whose engine is full still polls Kafka now and then, fetching nothing (a
stand-in for its consumer; the real one: tests/integration/test_worker.py). aiokafka
leaves the group after five minutes without a poll, and every slot busy that long
happens on slow CPUs: the worker's partitions moved away mid-reply and it rejoined when
a slot freed."""

from __future__ import annotations

from typing import Any, cast

from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord

from tandoor.settings import Settings
from workers.intake import PromptIntake


class StandInConsumer:
    def __init__(self, topic: str) -> None:
        self.assigned = {TopicPartition(topic, 0), TopicPartition(topic, 1)}
        self.paused: set[TopicPartition] = set()
        self.polls: list[tuple[set[TopicPartition], int]] = []  # paused, and the timeout
        self.seeks: list[tuple[TopicPartition, int]] = []

    def assignment(self) -> set[TopicPartition]:
        return self.assigned

    def pause(self, *partitions: TopicPartition) -> None:
        self.paused |= set(partitions)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.seeks.append((tp, offset))

    async def end_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        return dict.fromkeys(tps, 0)

    async def position(self, _: TopicPartition) -> int:
        return 0

    async def getmany(self, timeout_ms: int) -> dict[TopicPartition, list[Any]]:
        self.polls.append((set(self.paused), timeout_ms))
        # Records fetched for partition 1 before it was paused (it was just assigned).
        tp = TopicPartition(next(iter(self.assigned)).topic, 1)
        return {tp: [ConsumerRecord(tp.topic, 1, 7, 0, 0, b"k", b"v", None, 1, 1, [])]}


async def test_a_full_worker_polls_fetching_nothing_and_loses_nothing_fetched() -> None:
    settings = Settings()
    intake = PromptIntake(settings, settings.served_models[0])
    await intake.consumer.stop()  # never started: closed for its finalizer
    consumer = StandInConsumer(intake.topic)
    intake.consumer = cast(Any, consumer)
    await intake.poll_while_full()
    # Every partition paused, and a poll that returns at once (one cancelled midway
    # left aiokafka counting it as under way: its check off for good).
    assert consumer.polls == [(consumer.assigned, 0)]
    assert consumer.seeks == [(TopicPartition(intake.topic, 1), 7)]  # fetched again later
