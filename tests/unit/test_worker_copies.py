"""A rebalance restarts even the partitions a worker keeps from their committed offset,
the oldest prompt still running: the prompts it runs are fetched again. Each copy held
a slot until its original finished, so after a scaling event a worker could fill every
free slot with copies and start nothing new for minutes (pure logic: the worker's own
handling, a stand-in for the runner)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from aiokafka.structs import ConsumerRecord

from schemas.codec import encode
from schemas.events import PromptRequest
from schemas.topics import prompts_topic
from tandoor.settings import Settings
from tests.unit.test_transcript_records import prompt
from tests.waiting import until
from workers.attempt import Tracked
from workers.capacity import Capacity
from workers.engine import EngineOptions
from workers.worker import Worker

MODEL = "smollm2"


class HeldRunner:
    """Runs each prompt until the test lets the first one finish."""

    def __init__(self) -> None:
        self.runs: list[str] = []
        self.finish = asyncio.Event()
        self.capacity: Capacity | None = None
        self.slots_taken: list[int] = []  # at the start of each run

    async def run(self, prompt: PromptRequest, tracked: Tracked, band: str) -> None:
        self.runs.append(prompt.request_id)
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
    """The clients a Worker makes on creation, never started here."""
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

    async def run(self, prompt: PromptRequest, tracked: Tracked, band: str) -> None:
        await super().run(prompt, tracked, band)
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
