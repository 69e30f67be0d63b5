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

from schemas.codec import encode
from schemas.topics import prompts_topic
from tandoor.settings import Settings
from tests.unit.test_rollups import final_event, usage
from tests.unit.test_transcript_records import LeasesKept, prompt
from tests.unit.test_worker_copies import MODEL, closed, prompt_record
from tests.waiting import until
from workers.attempt import Tracked
from workers.engine import EngineOptions
from workers.ledger import Arrival, Finished
from workers.request import RequestRunner, RunnerConfig
from workers.worker import Worker

TOPIC = prompts_topic(MODEL)


class Ledger:
    """The request is this worker's; what was let go once delivered."""

    def __init__(self) -> None:
        self.delivered_ids: list[str] = []
        self.released: list[str] = []  # besides delivered, which gives the lease back

    async def arrive(self, request_id: str, batch_cancel: str | None) -> Arrival | Finished:
        return Arrival(attempt=1, cancelled=False, leased=True)

    async def delivered(self, request_id: str) -> None:
        self.delivered_ids.append(request_id)

    async def release(self, request_id: str) -> None:
        self.released.append(request_id)


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
        # Delivered gave the lease back: a second release, under the worker-wide lock,
        # held up the prompt's commit by another Redis round trip.
        assert ledger.released == []
        assert worker.intake.offsets.to_commit() == {(TOPIC, 0): 6}
        assert worker.metrics.usage_unsent._value.get() == 0
        assert dict(worker.intake.held) == {"interactive-paid": 0}
        assert worker.capacity.free_seqs == free and worker._failure is None
    finally:
        handled.cancel()
        await closed(worker)


class RecordedFinal(Ledger):
    """The request's worker died after recording its final: this one delivers it."""

    async def arrive(self, request_id: str, batch_cancel: str | None) -> Arrival | Finished:
        return Finished(encode(final_event(request_id, 1)))


class Kafka(UsageTopicDown):
    def __init__(self) -> None:
        super().__init__()
        self.finals: list[str] = []

    async def final(self, final: Any, partition: int | None) -> None:
        self.finals.append(final.request_id)


async def test_a_recorded_final_is_delivered_under_a_lease_kept_while_kafka_holds_usage() -> None:
    """Its delivery lease lapsed while Kafka held the usage record back (minutes, for a
    partition with no leader): another worker waiting on the request found the final
    still recorded and no lease, and published it again."""
    worker = Worker(Settings(), MODEL, EngineOptions(model_dir=Path(".")))
    ledger, kafka = RecordedFinal(), Kafka()
    runner = RequestRunner(
        RunnerConfig(MODEL, 0.1, 16),
        cast(Any, None),
        cast(Any, kafka),
        cast(Any, ledger),
        worker.capacity,
        worker.metrics,
    )
    tracked = Tracked("r_1")
    delivering = asyncio.create_task(runner.run(prompt(), tracked, "interactive-paid"))
    try:
        await until(lambda: kafka.finals, what="the final out", idle_s=10)
        assert tracked.leased, "the renewal loop keeps only leases marked held"
        kafka.back.set()
        await asyncio.wait_for(delivering, 10)
        assert kafka.sent == 1 and ledger.delivered_ids == ["r_1"]
        assert not tracked.leased and tracked.delivered
    finally:
        delivering.cancel()
        await closed(worker)


class UsageRefused(Kafka):
    """The final goes out; Kafka refuses the usage record, once the test lets it."""

    async def usage(self, record: Any) -> None:
        await self.back.wait()
        raise RuntimeError("usage refused")


class FinishingLedger(Ledger):
    leases = LeasesKept()

    async def finish(self, request_id: str, attempt: int, final: bytes) -> bool:
        return True


class Finishing(RequestRunner):
    """The real runner, its engine part answering at once through `_finish`."""

    async def _run(self, attempt: Any) -> None:
        await self._finish(attempt, "stop", None)


async def test_a_copy_waiting_on_a_reply_whose_usage_failed_does_not_commit_it() -> None:
    """The original was marked answered as its final went out: when its usage record
    then failed, the copy fetched after a rebalance skipped the prompt and committed
    past it, and no worker ever sent the usage record."""
    worker = Worker(Settings(), MODEL, EngineOptions(model_dir=Path(".")))
    kafka = UsageRefused()
    worker._runner = Finishing(
        RunnerConfig(MODEL, 0.1, 16),
        cast(Any, None),
        cast(Any, kafka),
        cast(Any, FinishingLedger()),
        worker.capacity,
        worker.metrics,
    )
    original, copy = prompt_record(5), prompt_record(5)
    handled = []
    for record in (original, copy):
        worker.capacity.take_seq()
        worker.intake._taken({TopicPartition(TOPIC, 0): [record]})
        handled.append(asyncio.create_task(worker._handle(record)))
        if record is original:  # a rebalance revokes even the partitions a worker keeps
            await worker.intake.on_partitions_revoked([TopicPartition(TOPIC, 0)])
    try:
        await until(lambda: kafka.finals, what="the final out", idle_s=10)
        kafka.back.set()  # and its usage record refused
        await asyncio.wait_for(asyncio.gather(*handled), 10)
        assert worker._failure is not None
        assert worker.intake.offsets.to_commit() == {(TOPIC, 0): 5}, "committed past it"
    finally:
        for task in handled:
            task.cancel()
        await closed(worker)
