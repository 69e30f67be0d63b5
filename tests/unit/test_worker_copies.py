"""A rebalance restarts even the partitions a worker keeps from their committed offset,
the oldest prompt still running: the prompts it runs are fetched again. Each copy held
a slot until its original finished, so after a scaling event a worker could fill every
free slot with copies and start nothing new for minutes (pure logic: the worker's own
handling, a stand-in for the runner)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from aiokafka.structs import ConsumerRecord

from schemas.codec import encode
from schemas.events import ControlEvent, PromptRequest
from schemas.topics import prompts_topic
from tandoor.settings import Settings
from tests.unit.test_transcript_records import prompt
from tests.waiting import until
from workers.attempt import Tracked
from workers.capacity import Capacity
from workers.engine import EngineOptions
from workers.ledger import UNLEASED, Arrival, Busy, Finished
from workers.request import NO_SLOT, RequestRunner, RunnerConfig
from workers.slot import Slot, Waiter
from workers.worker import Worker

MODEL = "smollm2"


class HeldRunner:
    """Runs each prompt until the test lets the first one finish."""

    def __init__(self) -> None:
        self.runs: list[str] = []
        self.finish = asyncio.Event()
        self.capacity: Capacity | None = None
        self.slots_taken: list[int] = []  # at the start of each run

    async def run(
        self, prompt: PromptRequest, tracked: Tracked, band: str, slot: Waiter = NO_SLOT
    ) -> None:
        self.runs.append(prompt.request_id)
        await slot.take_again()  # as the runner does once it has the lease
        if self.capacity is not None:
            self.slots_taken.append(self.capacity.seqs)
        await self.finish.wait()


def prompt_record(offset: int) -> ConsumerRecord[bytes, bytes]:
    value = encode(prompt())
    return ConsumerRecord(prompts_topic(MODEL), 0, offset, 0, 0, b"k", value, None, 1, 0, [])


def taken_twice(worker: Worker, runner: HeldRunner) -> list[asyncio.Task[None]]:
    """The prompt taken, then fetched again after a rebalance, each handled."""
    worker._runner = runner  # type: ignore[assignment]
    runner.capacity = worker.capacity
    handled = []
    for _ in range(2):
        worker.capacity.take_seq()
        worker.intake.held["interactive-paid"] += 1  # as intake counts what it takes
        handled.append(asyncio.create_task(worker._handle(prompt_record(5))))
    return handled


async def stopped(worker: Worker, runner: HeldRunner, handled: list[asyncio.Task[None]]) -> None:
    runner.finish.set()
    await asyncio.gather(*handled, return_exceptions=True)
    await closed(worker)


async def closed(worker: Worker) -> None:
    """The clients a Worker makes on creation, never started here, and its cancels being
    noted in Redis."""
    await worker._noting.cancel()
    await worker._producer.stop()
    await worker.intake.consumer.stop()
    await worker.control.stop()
    await worker._redis.aclose()


async def test_a_prompt_fetched_again_while_it_runs_gives_its_slot_back() -> None:
    worker, runner = Worker(Settings(), MODEL, EngineOptions(model_dir=Path("."))), HeldRunner()
    free = worker.capacity.free_seqs
    handled = taken_twice(worker, runner)
    try:
        await until(
            lambda: worker.capacity.free_seqs,
            lambda f: f == free - 1,
            what="a slot back",
            idle_s=10,
            poll_s=0.01,
        )
        assert runner.runs == ["r_1"]  # the copy waits for the original, slot-free
        # and is not in flight twice: counted so, it kept lower bands from the free
        # slots (the scheduler's headroom) until the original ended
        assert dict(worker.intake.held) == {"interactive-paid": 1}
        runner.finish.set()
        await asyncio.wait_for(asyncio.gather(*handled), 10)
        assert runner.runs == ["r_1"] * 2  # then runs, and finds it answered
        assert runner.slots_taken == [2, 1], "the copy runs in a slot, as any prompt"
        assert worker.capacity.free_seqs == free
        assert dict(worker.intake.held) == {"interactive-paid": 0}
        assert worker._failure is None
    finally:
        await stopped(worker, runner, handled)


class AnsweringRunner(HeldRunner):
    """Publishes the first run's final, as the real runner marks it."""

    async def run(
        self, prompt: PromptRequest, tracked: Tracked, band: str, slot: Waiter = NO_SLOT
    ) -> None:
        await super().run(prompt, tracked, band, slot)
        tracked.delivered = True


async def test_a_copy_of_a_prompt_answered_here_is_not_run_again() -> None:
    """With Redis down the copy could not learn that the reply was delivered: it ran
    the whole reply again and published a second, different final."""
    worker = Worker(Settings(), MODEL, EngineOptions(model_dir=Path(".")))
    runner = AnsweringRunner()
    free = worker.capacity.free_seqs
    handled = taken_twice(worker, runner)
    try:
        await until(lambda: runner.runs, what="the original running", idle_s=10, poll_s=0.01)
        runner.finish.set()
        await asyncio.wait_for(asyncio.gather(*handled), 10)
        assert runner.runs == ["r_1"]
        assert worker.capacity.free_seqs == free
        assert dict(worker.intake.held) == {"interactive-paid": 0}
        assert worker._failure is None
    finally:
        await stopped(worker, runner, handled)


class OtherWorkersRequest:
    """A ledger whose request another worker holds until the test lets it go: then
    delivered (`done`), or handed back (`leased` to this one)."""

    def __init__(self) -> None:
        self.let_go = asyncio.Event()
        self.outcome: Finished | Arrival = Finished(None)

    async def arrive(self, request_id: str, batch_cancel: str | None) -> object:
        return self.outcome if self.let_go.is_set() else Busy(50)

    async def release(self, request_id: str) -> None:
        return None


class SlotsAtRun(RequestRunner):
    """The real runner up to the engine: notes the slots taken when it would start."""

    slots_taken: list[int]

    async def _run(self, attempt: object) -> None:
        self.slots_taken.append(self.capacity.seqs)


def waiting_on_another_worker(worker: Worker, ledger: OtherWorkersRequest) -> SlotsAtRun:
    config = RunnerConfig(MODEL, 0.1, 16)
    runner = SlotsAtRun(config, None, None, ledger, worker.capacity, worker.metrics)  # type: ignore[arg-type]
    runner.slots_taken = []
    worker._runner = runner
    worker.capacity.take_seq()
    worker.intake.held["interactive-paid"] += 1  # as intake counts what it takes
    return runner


async def test_a_prompt_another_worker_runs_waits_without_a_slot() -> None:
    """A rebalance hands every running prompt's partition to a new owner, which fetches
    them all again: each held a slot while it waited for the old owner's reply to end,
    so a worker added to take load started nothing for as long as the longest reply."""
    worker = Worker(Settings(), MODEL, EngineOptions(model_dir=Path(".")))
    ledger, free = OtherWorkersRequest(), worker.capacity.free_seqs
    runner = waiting_on_another_worker(worker, ledger)
    handled = asyncio.create_task(worker._handle(prompt_record(5)))
    try:
        await until(
            lambda: worker.capacity.free_seqs, lambda f: f == free, what="the slot back", idle_s=10
        )
        assert dict(worker.intake.held) == {"interactive-paid": 0}
        ledger.let_go.set()  # delivered by the other worker: nothing runs here
        await asyncio.wait_for(handled, 10)
        assert runner.slots_taken == [] and worker.capacity.free_seqs == free
        assert dict(worker.intake.held) == {"interactive-paid": 0}
        assert worker._failure is None
    finally:
        handled.cancel()
        await closed(worker)


async def test_a_prompt_handed_back_by_another_worker_runs_in_a_slot() -> None:
    worker = Worker(Settings(), MODEL, EngineOptions(model_dir=Path(".")))
    ledger, free = OtherWorkersRequest(), worker.capacity.free_seqs
    ledger.outcome = Arrival(attempt=2, cancelled=False, leased=True)
    runner = waiting_on_another_worker(worker, ledger)
    handled = asyncio.create_task(worker._handle(prompt_record(5)))
    try:
        await until(
            lambda: worker.capacity.free_seqs, lambda f: f == free, what="the slot back", idle_s=10
        )
        ledger.let_go.set()
        await asyncio.wait_for(handled, 10)
        assert runner.slots_taken == [1], "it runs in a slot again, as any prompt"
        assert worker.capacity.free_seqs == free
        assert dict(worker.intake.held) == {"interactive-paid": 0}
        assert worker._failure is None
    finally:
        handled.cancel()
        await closed(worker)


class TakenOverWhenLetGo(OtherWorkersRequest):
    def __init__(self) -> None:
        super().__init__()
        self.outcome = Arrival(attempt=2, cancelled=False, leased=True)
        self.cancels: list[str] = []

    async def mark_cancelled(self, request_id: str) -> None:
        self.cancels.append(request_id)


class AnsweredAtRun(SlotsAtRun):
    """Notes whether the stop was known when the runner went on, and in a slot or not."""

    async def _run(self, attempt: Any) -> None:
        self.slots_taken.append(self.capacity.seqs)
        self.stopped_at_run = attempt.tracked.cancelled


async def test_a_stop_reaches_a_taken_over_reply_that_waits_for_a_slot() -> None:
    """Its worker crashed, this one took it over while its own slots were full: the
    reply waited for a slot, and Stop (or its lost lease) waited as long, minutes on a
    busy CPU, though answering it needs no engine."""
    worker = Worker(Settings(), MODEL, EngineOptions(model_dir=Path(".")))
    ledger = TakenOverWhenLetGo()
    config = RunnerConfig(MODEL, 0.1, 16)
    runner = AnsweredAtRun(config, None, None, ledger, worker.capacity, worker.metrics)  # type: ignore[arg-type]
    runner.slots_taken, worker._runner = [], runner
    worker.capacity.take_seq()
    worker.intake.held["interactive-paid"] += 1
    full = worker.capacity.max_seqs
    handled = asyncio.create_task(worker._handle(prompt_record(5)))
    try:
        await until(lambda: worker.capacity.seqs, lambda s: s == 0, what="the slot back", idle_s=10)
        for _ in range(full):
            worker.capacity.take_seq()  # the intake fills every slot meanwhile
        ledger.let_go.set()  # the other worker died: this one has the lease now
        await until(lambda: runner.metrics.waiting._value.get(), lambda w: w == 1, what="waiting")
        cancel = ControlEvent(command="cancel", request_id=prompt().request_id, issued_at_ms=1)
        await worker._on_cancel(cancel)
        await asyncio.wait_for(handled, 10)  # a failure guard only
        assert runner.slots_taken == [full] and runner.stopped_at_run, "answered without a slot"
        assert worker.capacity.seqs == full, "no slot taken past the count"
    finally:
        handled.cancel()
        await closed(worker)


class DeliveredElsewhereThenRedisDown(OtherWorkersRequest):
    """Once let go, the request is found done (its final delivered by another worker, or
    by this one from the record); then Redis is out of reach: an arrival is taken as a
    first attempt, unleased."""

    def __init__(self) -> None:
        super().__init__()
        self.found_done = False

    async def arrive(self, request_id: str, batch_cancel: str | None) -> object:
        if not self.let_go.is_set():
            return Busy(50)
        if not self.found_done:
            self.found_done = True
            return Finished(None)
        return UNLEASED


async def test_a_copy_of_a_prompt_its_original_found_done_is_not_run() -> None:
    """The original waited out a dead worker's lease, found the request done and
    returned, not marked as answered: its copy (fetched again meanwhile, a rebalance)
    asked Redis again and, Redis out of reach, ran the whole reply as a first attempt:
    a second, different final."""
    worker = Worker(Settings(), MODEL, EngineOptions(model_dir=Path(".")))
    ledger, free = DeliveredElsewhereThenRedisDown(), worker.capacity.free_seqs
    runner = waiting_on_another_worker(worker, ledger)
    worker.capacity.take_seq()  # the copy's, as intake takes it
    worker.intake.held["interactive-paid"] += 1
    handled = [asyncio.create_task(worker._handle(prompt_record(5))) for _ in range(2)]
    try:
        await until(
            lambda: worker.capacity.free_seqs, lambda f: f == free, what="slots back", idle_s=10
        )
        ledger.let_go.set()
        await asyncio.wait_for(asyncio.gather(*handled), 10)
        assert runner.slots_taken == [], "the copy ran the reply again"
        assert worker.capacity.free_seqs == free
        assert worker._failure is None
    finally:
        for task in handled:
            task.cancel()
        await closed(worker)


class QuietIntake:
    """The worker's intake loop over a stand-in fetch: the first fetch brings `first`
    prompts once a copy waits to take its slot back; later ones bring none."""

    def __init__(self, worker: Worker, first: int) -> None:
        self.worker, self.first = worker, first
        self.fetches = 0
        self.most: list[int] = []  # slots held as each fetched prompt is handled
        self.copy_waits = asyncio.Event()
        self.loop: asyncio.Task[None] | None = None
        worker.intake.take = self.take  # type: ignore[method-assign]
        worker.intake.poll_while_full = self.poll_while_full  # type: ignore[method-assign]
        worker._handle = self.handle  # type: ignore[method-assign]

    async def take(self, free_slots: int) -> list[ConsumerRecord[bytes, bytes]]:
        self.fetches += 1
        if self.fetches == 1:
            await self.copy_waits.wait()
            return [prompt_record(7 + i) for i in range(min(self.first, free_slots))]
        await asyncio.sleep(0.01)  # Kafka's long poll, on a quiet topic
        return []

    async def poll_while_full(self) -> None:
        return None  # the real one keeps the group membership: no Kafka here

    async def handle(self, record: ConsumerRecord[bytes, bytes]) -> None:
        self.most.append(self.worker.capacity.seqs)

    async def copy_takes_its_slot_back(self) -> bool:
        given_back = Slot(self.worker.capacity, self.worker.intake, prompt_record(3), held=False)
        waiting = asyncio.ensure_future(given_back.take_again())
        self.copy_waits.set()
        return await waiting


async def copy_beside_the_intake(first: int) -> tuple[Worker, QuietIntake, asyncio.Task[bool]]:
    worker = Worker(Settings(), MODEL, EngineOptions(model_dir=Path(".")))
    worker.capacity.take_seq(worker.capacity.max_seqs - 1)  # one slot free
    intake = QuietIntake(worker, first)
    intake.loop = asyncio.create_task(worker._intake_loop())
    await until(lambda: intake.fetches, bool, what="a fetch", idle_s=10)
    return worker, intake, asyncio.create_task(intake.copy_takes_its_slot_back())


async def stop_intake(worker: Worker, intake: QuietIntake) -> None:
    worker.request_stop()
    if intake.loop is not None:
        await asyncio.wait_for(intake.loop, 40)
    await asyncio.gather(*worker._tasks)
    await closed(worker)


async def test_a_copy_taking_its_slot_back_while_prompts_are_fetched_waits() -> None:
    """The intake read the free slots, then fetched for up to 100 ms: a copy that took its
    slot back meanwhile, and every prompt fetched then took one too. The engine held
    more than max_num_seqs, and the one too many waited in vLLM's queue past its
    deadline."""
    worker, intake, copy = await copy_beside_the_intake(first=1)
    try:
        await until(lambda: intake.most, bool, what="the fetched prompt handled", idle_s=10)
        assert max(intake.most) <= worker.capacity.max_seqs, intake.most
        assert not copy.done(), "it waits for a reply to end"
        await worker.capacity.release_seq()  # one does: the copy gets its slot
        await until(lambda: copy.done(), bool, what="the copy's slot", idle_s=10, poll_s=0.01)
    finally:
        copy.cancel()
        await stop_intake(worker, intake)


async def test_a_copy_taking_its_slot_back_goes_before_new_prompts() -> None:
    """Held while each fetch ran, the free slots were taken again by the next fetch
    before a copy woken by their release could take one: on a quiet worker it waited
    until its reply expired."""
    worker, intake, copy = await copy_beside_the_intake(first=0)
    try:
        await until(lambda: copy.done(), bool, what="the copy's slot", idle_s=10, poll_s=0.01)
        assert copy.result() and worker.capacity.seqs == worker.capacity.max_seqs
    finally:
        copy.cancel()
        await stop_intake(worker, intake)
