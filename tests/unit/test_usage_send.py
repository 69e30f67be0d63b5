"""A reply's usage record, once its final is out, is sent with no engine slot held and
its prompt left unfinished until Kafka takes it: a `usage` partition with no leader
stopped the worker, and each worker the prompt went to next published the final again
and stopped too (pure logic: the worker's own handling, stand-ins for the ledger, the
engine and Kafka)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

from aiokafka import TopicPartition

from schemas.topics import prompts_topic
from tandoor.settings import Settings
from tests.unit.test_rollups import usage
from tests.unit.test_worker_copies import MODEL, closed, prompt_record
from tests.waiting import until
from workers.engine import EngineOptions
from workers.ledger import Arrival
from workers.request import RequestRunner, RunnerConfig
from workers.worker import Worker

TOPIC = prompts_topic(MODEL)


class Ledger:
    """The request is this worker's; what was let go once delivered."""

    def __init__(self) -> None:
        self.delivered_ids: list[str] = []

    async def arrive(self, request_id: str, batch_cancel: str | None) -> Arrival:
        return Arrival(attempt=1, cancelled=False, leased=True)

    async def delivered(self, request_id: str) -> None:
        self.delivered_ids.append(request_id)

    async def release(self, request_id: str) -> None:
        return None


class UsageTopicDown:
    """Kafka takes the usage record only once the test lets it."""

    def __init__(self) -> None:
        self.back, self.sent = asyncio.Event(), 0

    async def usage(self, record: Any) -> None:
        await self.back.wait()
        self.sent += 1


class Answered(RequestRunner):
    """The real runner, its engine part answering at once as `_finish` leaves it."""

    async def _run(self, attempt: Any) -> None:
        attempt.usage_due = usage(attempt.prompt.request_id)


async def test_a_usage_record_kafka_holds_back_holds_no_slot_and_no_commit() -> None:
    worker = Worker(Settings(), MODEL, EngineOptions(model_dir=Path(".")))
    ledger, kafka, free = Ledger(), UsageTopicDown(), worker.capacity.free_seqs
    engine, publisher, stand_in_ledger = cast(Any, None), cast(Any, kafka), cast(Any, ledger)
    config = RunnerConfig(MODEL, 0.1, 16)
    worker._runner = Answered(
        config, engine, publisher, stand_in_ledger, worker.capacity, worker.metrics
    )
    worker.capacity.take_seq()
    record = prompt_record(5)
    worker.intake._taken({TopicPartition(TOPIC, 0): [record]})  # as intake takes it
    handled = asyncio.create_task(worker._handle(record))
    try:
        await until(
            lambda: worker.capacity.free_seqs, lambda f: f == free, what="the slot back", idle_s=10
        )
        assert worker.metrics.usage_unsent._value.get() == 1
        assert ledger.delivered_ids == []
        assert worker.intake.offsets.to_commit() == {(TOPIC, 0): 5}  # not past it
        kafka.back.set()
        await asyncio.wait_for(handled, 10)
        assert kafka.sent == 1 and ledger.delivered_ids == ["r_1"]
        assert worker.intake.offsets.to_commit() == {(TOPIC, 0): 6}
        assert worker.metrics.usage_unsent._value.get() == 0
        assert dict(worker.intake.held) == {"interactive-paid": 0}
        assert worker.capacity.free_seqs == free and worker._failure is None
    finally:
        handled.cancel()
        await closed(worker)
