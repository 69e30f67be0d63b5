"""A prompt partition past every configured band (the topic grew for a wider band
before this worker's settings did): its prompts are taken as the lowest band's, not a
ValueError that stopped every worker given one of the new partitions at once (a
stand-in for the consumer)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from aiokafka import TopicPartition
from aiokafka.errors import KafkaConnectionError
from aiokafka.structs import ConsumerRecord

from tandoor.settings import Settings
from workers.intake import BACKLOG_WHILE_FULL_S, PromptIntake

WAITING = 5  # prompts in each partition


class GrownTopic:
    """Every partition of the layout and one more, each holding WAITING prompts."""

    def __init__(self, topic: str, partitions: int) -> None:
        self.assigned = {TopicPartition(topic, p) for p in range(partitions + 1)}
        self.outside = TopicPartition(topic, partitions)
        self.asked: list[set[TopicPartition]] = []

    def assignment(self) -> set[TopicPartition]:
        return self.assigned

    def resume(self, *_: TopicPartition) -> None:
        pass

    def paused(self) -> set[TopicPartition]:
        return set()

    def pause(self, *_: TopicPartition) -> None:
        pass

    async def end_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        return dict.fromkeys(tps, WAITING)

    async def position(self, _: TopicPartition) -> int:
        return 0

    async def getmany(
        self, *tps: TopicPartition, timeout_ms: int = 0, max_records: int | None = None
    ) -> dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]:
        self.asked.append(set(tps))
        if self.outside not in tps:  # (none named: a poll while full, nothing fetched)
            return {}
        tp = self.outside
        return {tp: [ConsumerRecord(tp.topic, tp.partition, 0, 0, 0, b"k", b"v", None, 1, 1, [])]}


async def test_a_partition_past_every_band_is_read_as_the_lowest_band() -> None:
    settings = Settings()
    intake = PromptIntake(settings, settings.served_models[0])
    await intake.consumer.stop()  # never started: closed for its finalizer
    consumer = GrownTopic(intake.topic, intake.layout.total_partitions)
    intake.consumer = cast(Any, consumer)
    lowest = intake.layout.ranges[-1].name
    for _ in range(20):  # until the lowest band's turn comes
        taken = await intake.take(4)
        if taken:
            break
    assert [record.partition for record in taken] == [consumer.outside.partition]
    assert intake.band_of(taken[0]) == lowest
    assert intake.held[lowest] == 1
    assert intake.backlog[lowest] >= WAITING  # its prompts count as waiting there


async def test_the_backlog_is_measured_while_the_worker_is_full_and_every_band_shown() -> None:
    """The lag gauge was set only after a take: with every slot busy (for minutes on a
    CPU) it stayed at the low value read as the worker filled up, and a band whose
    partitions all moved away kept its last value."""
    settings = Settings()
    intake = PromptIntake(settings, settings.served_models[0])
    await intake.consumer.stop()
    consumer = GrownTopic(intake.topic, intake.layout.total_partitions - 1)
    intake.consumer = cast(Any, consumer)
    await intake.poll_while_full()
    assert sum(intake.backlog.values()) == WAITING * intake.layout.total_partitions
    consumer.assigned = set()  # every partition moved to other workers
    intake._lag_checked = 0.0
    await intake.poll_while_full()
    assert intake.backlog == {band.name: 0 for band in intake.layout.ranges}


class SlowBroker(GrownTopic):
    async def end_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        await asyncio.sleep(60)  # a leader being elected
        return await super().end_offsets(tps)


async def test_a_full_worker_measuring_its_backlog_is_not_held_up_by_a_slow_broker() -> None:
    """Slots that free meanwhile would wait for the measurement (40 s per request)."""
    settings = Settings()
    intake = PromptIntake(settings, settings.served_models[0])
    await intake.consumer.stop()
    intake.consumer = cast(Any, SlowBroker(intake.topic, intake.layout.total_partitions - 1))
    await asyncio.wait_for(intake.poll_while_full(), BACKLOG_WHILE_FULL_S + 5)


class Pausing(GrownTopic):
    """Keeps which partitions are paused, as aiokafka does."""

    def __init__(self, topic: str, partitions: int) -> None:
        super().__init__(topic, partitions)
        self.held_back: set[TopicPartition] = set()

    def pause(self, *tps: TopicPartition) -> None:
        self.held_back |= set(tps)

    def resume(self, *tps: TopicPartition) -> None:
        self.held_back -= set(tps)

    def paused(self) -> set[TopicPartition]:
        return self.held_back & self.assigned

    async def getmany(
        self, *tps: TopicPartition, timeout_ms: int = 0, max_records: int | None = None
    ) -> dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]:
        readable = [tp for tp in tps or self.assigned if tp not in self.held_back]
        self.asked.append(set(readable))
        return {}


async def test_partitions_paused_as_a_rebalance_assigns_them_are_resumed() -> None:
    """aiokafka sets the new assignment, then awaits a task before it calls the
    listener: a full worker's poll in between paused the new partitions, and the
    listener then noted nothing paused. The worker took nothing until the next
    rebalance, and said it was ready."""
    settings = Settings()
    intake = PromptIntake(settings, settings.served_models[0])
    await intake.consumer.stop()
    consumer = Pausing(intake.topic, intake.layout.total_partitions - 1)
    intake.consumer = cast(Any, consumer)
    await intake.poll_while_full()  # the new assignment, paused by a full worker
    await intake.on_partitions_assigned(list(consumer.assigned))
    await intake.take(4)  # a slot freed
    assert consumer.paused() == set()
    assert consumer.asked[-1], "no partition was read"


class FailingAfterFirst(GrownTopic):
    """The first band's fetch brings a prompt; the next fails (a broker restarting)."""

    async def getmany(
        self, *tps: TopicPartition, timeout_ms: int = 0, max_records: int | None = None
    ) -> dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]:
        if self.asked:
            raise KafkaConnectionError("the broker went away")
        self.asked.append(set(tps))
        tp = min(tps, key=lambda t: t.partition)
        return {tp: [ConsumerRecord(tp.topic, tp.partition, 0, 0, 0, b"k", b"v", None, 1, 1, [])]}


async def test_prompts_taken_before_a_later_bands_fetch_fails_are_run() -> None:
    """They were counted in flight and held their partition's commit, then dropped with
    the error: never run, and nothing committed past them until a restart."""
    settings = Settings()
    intake = PromptIntake(settings, settings.served_models[0])
    await intake.consumer.stop()
    intake.consumer = cast(Any, FailingAfterFirst(intake.topic, intake.layout.total_partitions - 1))
    taken = await intake.take(30)  # every band has prompts waiting: three fetches
    assert [(r.partition, r.offset) for r in taken] == [(0, 0)]
    assert sum(intake.held.values()) == 1
