"""A worker whose engine is full keeps polling Kafka, fetching nothing (a stand-in for
its consumer; the real one: tests/integration/test_worker.py). aiokafka leaves the group
after five minutes without a poll, and every slot busy that long happens on slow CPUs:
the worker's partitions moved away mid-reply and it rejoined when a slot freed."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord

from tandoor.settings import Settings
from workers.intake import PromptIntake


class StandInConsumer:
    def __init__(self, topic: str) -> None:
        self.assigned = {TopicPartition(topic, 0)}
        self.paused: set[TopicPartition] = set()
        self.polls: list[set[TopicPartition]] = []  # what was paused at each poll
        self.seeks: list[tuple[TopicPartition, int]] = []
        self.polled_thrice = asyncio.Event()

    def assignment(self) -> set[TopicPartition]:
        return self.assigned

    def pause(self, *partitions: TopicPartition) -> None:
        self.paused |= set(partitions)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.seeks.append((tp, offset))

    async def getmany(self, timeout_ms: int) -> dict[TopicPartition, list[Any]]:
        self.polls.append(set(self.paused))
        await asyncio.sleep(0)
        if len(self.polls) == 1:  # a rebalance assigns another partition, unpaused yet
            new = TopicPartition(next(iter(self.assigned)).topic, 1)
            self.assigned = self.assigned | {new}
            return {new: [ConsumerRecord(new.topic, 1, 7, 0, 0, b"k", b"v", None, 1, 1, [])]}
        if len(self.polls) == 3:
            self.polled_thrice.set()
        return {}


async def test_a_full_worker_polls_fetching_nothing_and_loses_nothing_fetched() -> None:
    settings = Settings()
    intake = PromptIntake(settings, settings.served_models[0])
    await intake.consumer.stop()  # never started: closed for its finalizer
    consumer = StandInConsumer(intake.topic)
    intake.consumer = cast(Any, consumer)
    polling = asyncio.create_task(intake.poll_while_full())
    await asyncio.wait_for(consumer.polled_thrice.wait(), 10)
    polling.cancel()
    assert all(paused == consumer.assigned for paused in consumer.polls[1:]), consumer.polls
    assert consumer.seeks == [(TopicPartition(intake.topic, 1), 7)]  # fetched again later
