"""A reply's usage record, once its final is out, is sent with no engine slot held and
its prompt left unfinished until Kafka takes it: a `usage` partition with no leader
stopped the worker, and each worker the prompt went to next published the final again
and stopped too (pure logic: the worker's own handling, stand-ins for the ledger, the
engine and Kafka)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any, cast
from unittest.mock import AsyncMock

import pytest
from aiokafka import TopicPartition

from schemas.codec import encode
from schemas.topics import prompts_topic
from tandoor.settings import Settings
from tests.unit.test_rollups import final_event, usage
from tests.unit.test_transcript_records import LeasesKept, prompt
from tests.unit.test_worker_copies import MODEL, closed, prompt_record
from tests.waiting import until
from workers import recording
from workers.attempt import Attempt, Tracked
from workers.engine import EngineOptions
from workers.ledger import Arrival, Finished, RequestLedger
from workers.request import RequestRunner, RunnerConfig
from workers.worker import Worker

TOPIC = prompts_topic(MODEL)


class Ledger:
    """The request is this worker's; what was let go once delivered."""

    def __init__(self) -> None:
        self.delivered_ids: list[str] = []
        self.released: list[str] = []  # besides delivered, which gives the lease back
        self.marked_late: list[tuple[str, int]] = []
        self.recorded: list[bytes] = []  # finals recorded: Redis answers "ok"
        self.marking = asyncio.Event()  # set: delivered_unrecorded returns
        self.marking.set()

    async def finish(self, request_id: str, attempt: int, final: bytes) -> str:
        self.recorded.append(final)
        return "ok"

    async def arrive(self, request_id: str, batch_cancel: str | None) -> Arrival | Finished:
        return Arrival(attempt=1, cancelled=False, leased=True)

    async def delivered(self, request_id: str) -> None:
        self.delivered_ids.append(request_id)

    async def delivered_unrecorded(self, request_id: str, attempt: int) -> None:
        self.marked_late.append((request_id, attempt))
        await self.marking.wait()

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


class AnsweredUnrecorded(RequestRunner):
    """Its end went out while Redis was away (workers/late_done.py)."""

    async def _run(self, attempt: Any) -> None:
        attempt.usage_due = usage(attempt.prompt.request_id)
        attempt.tracked.unrecorded_final = b"the final"


def runner_in(worker: Worker, ledger: Ledger, kafka: UsageTopicDown, kind: Any) -> Any:
    """A `kind` of runner with the worker's capacity and metrics; no engine."""
    config, unused = RunnerConfig(MODEL, 0.1, 16), cast(Any, None)
    return kind(config, unused, kafka, ledger, worker.capacity, worker.metrics)


def answering_unrecorded(worker: Worker, ledger: Ledger, kafka: UsageTopicDown) -> Any:
    runner = runner_in(worker, ledger, kafka, AnsweredUnrecorded)
    return asyncio.create_task(runner.run(prompt(), Tracked("r_1"), "interactive-paid"))


async def test_an_end_redis_did_not_record_is_marked_done_once_its_usage_is_out() -> None:
    """Marked done as the final went out, with the usage record still held back by
    Kafka: a worker stopped then left the prompt to the next, which found it done,
    skipped it, and the usage record was never sent."""
    worker = Worker(Settings(), MODEL, EngineOptions(model_dir=Path(".")))
    ledger, kafka = Ledger(), UsageTopicDown()
    answering = answering_unrecorded(worker, ledger, kafka)
    try:
        await until(lambda: worker.metrics.usage_unsent._value.get(), what="the usage sent")
        assert ledger.marked_late == []
        kafka.back.set()
        await asyncio.wait_for(answering, 10)
        assert ledger.marked_late == [("r_1", 1)] and ledger.delivered_ids == []
        assert ledger.released == [] and ledger.recorded == []
    finally:
        answering.cancel()
        await closed(worker)


async def test_an_unrecorded_end_stopped_before_its_usage_is_out_is_left_recorded() -> None:
    """Stopped (its grace period over) while Kafka held the usage record back: nothing
    said it was answered, and the next worker answered it a second time from the
    transcript the outage cut short. Recorded now (Redis answers), it delivers both."""
    worker = Worker(Settings(), MODEL, EngineOptions(model_dir=Path(".")))
    ledger, kafka = Ledger(), UsageTopicDown()
    answering = answering_unrecorded(worker, ledger, kafka)
    try:
        await until(lambda: worker.metrics.usage_unsent._value.get(), what="the usage sent")
        answering.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await answering
        assert ledger.recorded == [b"the final"] and ledger.released == ["r_1"]
        assert ledger.marked_late == []
    finally:
        await closed(worker)


async def test_a_stop_while_the_done_mark_is_sent_leaves_the_lease_to_the_mark() -> None:
    """Its lease, given back as the stop cancelled the mark under way, let the next
    worker in before the mark: a second attempt from the cut-short transcript."""
    worker = Worker(Settings(), MODEL, EngineOptions(model_dir=Path(".")))
    ledger, kafka = Ledger(), UsageTopicDown()
    ledger.marking.clear()
    kafka.back.set()
    answering = answering_unrecorded(worker, ledger, kafka)
    try:
        await until(lambda: ledger.marked_late, what="the done mark under way")
        answering.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await answering
        assert ledger.released == [] and ledger.recorded == []
    finally:
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
    runner = runner_in(worker, ledger, kafka, RequestRunner)
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

    async def finish(self, request_id: str, attempt: int, final: bytes) -> str:
        return "ok"


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


class MarksOwed:
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def record(self) -> bool:
        self.calls.append("round")
        return True

    async def record_all(self) -> None:
        self.calls.append("all")


async def test_owed_done_marks_go_at_each_lease_round_and_all_at_a_stop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    worker = Worker(Settings(worker_lease_s=1), MODEL, EngineOptions(model_dir=Path(".")))
    marks = MarksOwed()
    monkeypatch.setattr(worker.ledger, "late_done", marks)
    monkeypatch.setattr(worker.ledger, "renew", AsyncMock(return_value=set()))
    monkeypatch.setattr(worker.intake, "commit", AsyncMock())
    renewing = asyncio.create_task(worker._renew_loop())
    try:
        await until(lambda: marks.calls, lambda calls: len(calls) >= 2, what="two rounds")
        assert set(marks.calls) == {"round"}
        renewing.cancel()
        await worker._drain()
        assert marks.calls[-1] == "all"
    finally:
        renewing.cancel()
        await closed(worker)


class LapsedOnce:
    """Redis says once that the lease is no longer ours, as it does, after the lease
    lapsed, for a request done by this worker's own FINISH whose answer was lost."""

    def __init__(self, request_id: str, finished: str) -> None:
        self.request_id, self.finished = request_id, finished
        self.rounds = 0
        self.sent_again: list[tuple[str, int, bytes]] = []
        self.handed_to_the_mark: Tracked | None = None  # its reply clears it meanwhile

    async def renew(self, held: dict[str, int]) -> set[str]:
        self.rounds += 1
        return {self.request_id} if self.rounds == 1 else set()

    async def finish(self, request_id: str, attempt: int, final: bytes) -> str:
        self.sent_again.append((request_id, attempt, final))
        if self.handed_to_the_mark is not None:  # the reply's own step, meanwhile
            self.handed_to_the_mark.unrecorded_final = None
        return self.finished


async def lease_rounds_with(
    answer: str, monkeypatch: pytest.MonkeyPatch, meanwhile_marked: bool = False
) -> Tracked:
    worker = Worker(Settings(worker_lease_s=1), MODEL, EngineOptions(model_dir=Path(".")))
    redis = LapsedOnce("r_1", answer)
    monkeypatch.setattr(worker.ledger, "late_done", MarksOwed())
    monkeypatch.setattr(worker.ledger, "renew", redis.renew)
    monkeypatch.setattr(worker.ledger, "finish", redis.finish)
    tracked = Tracked("r_1", leased=True, attempt=3, unrecorded_final=b"the final")
    redis.handed_to_the_mark = tracked if meanwhile_marked else None
    worker._tracked["r_1"] = tracked
    renewing = asyncio.create_task(worker._renew_loop())
    try:
        await until(lambda: redis.rounds, lambda rounds: rounds >= 2, what="two lease rounds")
    finally:
        renewing.cancel()
        await closed(worker)
    assert redis.sent_again == [("r_1", 3, b"the final")]
    return tracked


async def test_a_lease_round_finding_its_own_end_done_takes_the_lease_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The lease round asked before the reply did: it took the lease for another
    worker's and stopped renewing it, while the reply sent its final anyway."""
    tracked = await lease_rounds_with("ok", monkeypatch)
    assert not tracked.lost and tracked.unrecorded_final is None, "recorded, still ours"


async def test_a_lease_round_whose_final_the_late_mark_took_meanwhile_stops_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The late mark, run first, gave the lease back: the round's FINISH then heard
    "not yours", and a reply delivered in full was logged as taken by another worker."""
    tracked = await lease_rounds_with("lost", monkeypatch, meanwhile_marked=True)
    assert not tracked.lost


async def test_a_lease_round_finding_another_worker_on_it_stops_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tracked = await lease_rounds_with("lost", monkeypatch)
    assert tracked.lost and tracked.unrecorded_final == b"the final"


async def test_a_final_recorded_at_a_stop_is_not_sent_again_by_a_lease_round() -> None:
    """Left set, a lease round found the request done and sent the final again after
    the reply gave its lease back, taking the lease for its span: the next worker
    waited that long to deliver the final."""
    tracked = Tracked("r_1", leased=True, attempt=1, unrecorded_final=b"the final")
    ledger = Ledger()
    await recording.record_final_late(cast(RequestLedger, ledger), Attempt(prompt(), tracked, 1, 1))
    assert ledger.recorded == [b"the final"] and tracked.unrecorded_final is None
