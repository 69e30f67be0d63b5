"""A stopping worker hands its partitions to the rest of its group at once, not when
its grace period is over (new prompts on them waited it out, up to a minute in
Kubernetes), committing what it finished first; alone in the group it keeps them, so
what finishes there is still committed. Two workers' prompt intakes on Kafka: the
handing over is the intake's, the engine plays no part in it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import pytest
from aiokafka import AIOKafkaProducer

from infra.topics import TopicSpec, ensure_topics
from schemas.topics import prompts_topic
from tandoor.settings import Settings
from tests.integration.pipeline import committed_offset
from tests.waiting import eventually, until
from workers.intake import PromptIntake, Record

pytestmark = pytest.mark.integration


@pytest.fixture
async def model_settings(kafka: str, settings: Settings, unique: str) -> Settings:
    """Settings serving a model of its own: its topic and worker group are this test's."""
    model = f"leave-{unique}"
    partitions = sum(band.partitions for band in settings.bands)
    await ensure_topics(kafka, [TopicSpec(prompts_topic(model), partitions)])
    config = next(iter(settings.models.values()))
    return settings.model_copy(update={"models": {model: config}})


@pytest.fixture
async def intakes(model_settings: Settings) -> AsyncIterator[list[PromptIntake]]:
    """Started on demand: `intakes.append(...)` after `await intake.start()`."""
    started: list[PromptIntake] = []
    async with AsyncExitStack() as stack:
        yield started
        for intake in started:
            stack.push_async_callback(intake.consumer.stop)


async def joined(settings: Settings, intakes: list[PromptIntake]) -> PromptIntake:
    intake = PromptIntake(settings, next(iter(settings.models)))
    await intake.start()
    intakes.append(intake)
    return intake


def assigned(intake: PromptIntake) -> set[int]:
    return {tp.partition for tp in intake.consumer.assignment()}


async def test_a_stopping_worker_leaves_its_partitions_to_another_at_once(
    model_settings: Settings, intakes: list[PromptIntake], producer: AIOKafkaProducer
) -> None:
    model = next(iter(model_settings.models))
    every = set(range(sum(band.partitions for band in model_settings.bands)))
    alone = await joined(model_settings, intakes)
    await until(lambda: assigned(alone), lambda held: held == every, what="the first's join")
    assert not await alone.leave_for_others(), "alone: nobody would take them"
    assert assigned(alone) == every

    staying = await joined(model_settings, intakes)
    await until(
        lambda: (assigned(alone), assigned(staying)),
        lambda both: all(both) and not both[0] & both[1],
        what="the partitions spread over both",
    )
    # A prompt the leaving one finished: committed as it leaves, not run again.
    partition = min(assigned(alone))
    await producer.send_and_wait(prompts_topic(model), b"{}", partition=partition)
    taken: list[Record] = []

    async def take() -> list[Record]:
        taken.extend(await alone.take(1))
        return taken

    (record,) = await eventually(take, what="the prompt taken by the leaving one")
    alone.finished(record)

    assert await alone.leave_for_others()
    await until(lambda: assigned(staying), lambda held: held == every, what="the hand-over")
    assert await committed_offset(model_settings, model, partition) == record.offset + 1
