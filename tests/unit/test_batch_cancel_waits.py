"""A batch line that waits inside the worker (for a slot, then for token budget) looks
at its batch's cancel again before it runs (pure logic: the real runner up to the
engine, stand-ins for the ledger, the slot and Kafka)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, cast

from schemas.events import FinishReason
from tandoor.policies.redis_keys import batch_cancel_key
from tests.unit.test_transcript_records import PromptOf20Tokens, prompt
from tests.waiting import until
from workers.attempt import Attempt, Tracked
from workers.capacity import Capacity
from workers.ledger import Arrival
from workers.metrics import WorkerMetrics
from workers.request import RequestRunner, RunnerConfig


class Ledger:
    """Redis, as the runner asks it: no lease to be had, the batch cancels set here."""

    def __init__(self) -> None:
        self.cancelled: set[str] = set()

    async def arrive(self, request_id: str, batch_cancel: str | None) -> Arrival:
        return Arrival(attempt=1, cancelled=batch_cancel in self.cancelled, leased=False)

    async def cancelled_by(self, key: str | None) -> bool:
        return key in self.cancelled

    async def lease_late(self, request_id: str) -> str:
        return "down"

    async def delivered_unrecorded(self, request_id: str, attempt: int) -> None:
        return None  # unleased: marked done once Redis answers

    async def release(self, request_id: str) -> None:
        return None


class SlotTakenLater:
    """Given back while another worker had the request; held again when the test says."""

    def __init__(self) -> None:
        self.free, self.waiting = asyncio.Event(), False

    async def give_back(self) -> None:
        return None

    async def take_again(
        self, give_up: Callable[[], bool] = lambda: False, wake_in_s: float | None = None
    ) -> bool:
        self.waiting = True
        await self.free.wait()
        return True


class Kafka:
    def __init__(self) -> None:
        self.finals: list[str] = []

    async def final(self, final: Any, partition: int | None) -> None:
        self.finals.append(final.finish_reason)

    async def usage(self, record: Any) -> None:
        return None


class Engine(RequestRunner):
    """The real runner; what would reach the engine is noted instead."""

    ran: list[str]

    async def _stream(
        self, attempt: Attempt, token_ids: list[int], max_tokens: int
    ) -> FinishReason:
        self.ran.append(attempt.prompt.request_id)
        return "stop"


async def test_a_batch_cancelled_while_its_line_waits_for_a_slot_is_not_run() -> None:
    """Its cancel was looked at on arrival, and again only after a wait for token
    budget: a line that waited minutes for a slot on a full worker, then found budget at
    once, ran and was charged after "cancel batch" had answered."""
    ledger, kafka, slot = Ledger(), Kafka(), SlotTakenLater()
    line = prompt().model_copy(update={"kind": "batch", "batch_id": "batch_1"})
    runner = Engine(
        RunnerConfig("m", 0.05, 16),
        cast(Any, PromptOf20Tokens()),
        cast(Any, kafka),
        cast(Any, ledger),
        Capacity(max_seqs=4, max_tokens=10_000),
        WorkerMetrics("m"),
    )
    runner.ran = []
    running = asyncio.create_task(runner.run(line, Tracked("r_1"), "batch", slot))
    try:
        await until(lambda: slot.waiting, what="the line waiting for its slot", idle_s=10)
        ledger.cancelled.add(batch_cancel_key(line.user_id, "batch_1"))
        slot.free.set()
        await asyncio.wait_for(running, 10)
        assert (runner.ran, kafka.finals) == ([], ["cancelled"])
    finally:
        running.cancel()
