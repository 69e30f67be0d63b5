"""Offsets of a prompt fetched again while it runs (a rebalance restarts even a kept
partition from its commit), with a stand-in for the worker's consumer. The original's
end finished the copy's offset too: the commit passed a prompt whose copy still had to
run (the original lost its lease, the copy waited on the worker that took it), and had
both workers died then, the prompt was lost."""

from __future__ import annotations

from typing import Any, cast

from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord

from tandoor.settings import Settings
from workers.intake import PromptIntake


class StandInConsumer:
    def __init__(self, tp: TopicPartition) -> None:
        self.tp = tp

    def assignment(self) -> set[TopicPartition]:
        return {self.tp}

    async def commit(self, offsets: object) -> None:
        return None


def fetched(tp: TopicPartition, offset: int) -> ConsumerRecord[bytes, bytes]:
    return ConsumerRecord(tp.topic, tp.partition, offset, 0, 0, b"k", b"v", None, 1, 1, [])


async def test_the_original_of_a_prompt_fetched_again_does_not_finish_its_copy() -> None:
    settings = Settings()
    intake = PromptIntake(settings, settings.served_models[0])
    await intake.consumer.stop()  # never started: closed for its finalizer
    tp = TopicPartition(intake.topic, 0)
    intake.consumer = cast(Any, StandInConsumer(tp))
    original = fetched(tp, 5)
    intake._taken({tp: [original]})
    await intake.on_partitions_revoked([tp])  # kept, and restarted from its commit
    copy = fetched(tp, 5)
    intake._taken({tp: [copy]})
    intake.finished(original)  # it lost its lease: the copy waits for the new holder
    assert intake.offsets.to_commit() == {(tp.topic, 0): 5}, "the copy's prompt passed"
    intake.finished(copy)
    assert intake.offsets.to_commit() == {(tp.topic, 0): 6}
    assert dict(intake.held) == {"interactive-paid": 0}
