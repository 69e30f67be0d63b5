"""A Stop reaches the engine before Redis hears of it (pure logic: the worker's own
handling, stand-ins for the ledger and the engine)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from schemas.events import ControlEvent
from tandoor.settings import Settings
from tests.unit.test_worker_copies import MODEL, closed
from tests.waiting import until
from workers.attempt import Tracked
from workers.engine import EngineOptions
from workers.worker import Worker


class StalledRedis:
    """A ledger whose write of the cancel never comes back (Redis stalled)."""

    def __init__(self) -> None:
        self.marked: list[str] = []

    async def mark_cancelled(self, request_id: str) -> None:
        self.marked.append(request_id)
        await asyncio.Event().wait()


class Engine:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


async def test_a_stop_aborts_the_reply_before_it_is_noted_in_redis() -> None:
    """Each Stop waited for the Redis write first (up to its 2 s timeout, one Stop
    after the other), while the reply ran on and its tokens were charged."""
    worker = Worker(Settings(), MODEL, EngineOptions(model_dir=Path(".")))
    ledger, engine = StalledRedis(), Engine()
    worker.ledger, worker._engine = ledger, engine  # type: ignore[assignment]
    worker._tracked["r_1"] = Tracked("r_1", in_engine=True)
    cancel = ControlEvent(command="cancel", request_id="r_1", issued_at_ms=1)
    stopping = asyncio.create_task(worker._on_cancel(cancel))
    try:
        await until(lambda: engine.aborted, what="the engine's abort", idle_s=10, poll_s=0.01)
        assert worker._tracked["r_1"].cancelled and engine.aborted == ["r_1"]
        await until(lambda: ledger.marked, what="the cancel noted", idle_s=10, poll_s=0.01)
    finally:
        stopping.cancel()
        await closed(worker)


async def test_a_stop_is_not_held_behind_other_cancels_noted_in_redis() -> None:
    """Every worker sees every cancel, and its listener awaited each one's Redis write in
    turn: with Redis slow, a Stop for a reply running here waited behind cancels of
    replies running elsewhere."""
    worker = Worker(Settings(), MODEL, EngineOptions(model_dir=Path(".")))
    ledger, engine = StalledRedis(), Engine()
    worker.ledger, worker._engine = ledger, engine  # type: ignore[assignment]
    worker._tracked["r_1"] = Tracked("r_1", in_engine=True)

    async def listener() -> None:  # as workers/control.py hands them over: in turn
        for request_id in ("r_elsewhere", "r_1"):
            await worker._on_cancel(
                ControlEvent(command="cancel", request_id=request_id, issued_at_ms=1)
            )

    listening = asyncio.create_task(listener())
    try:
        await until(lambda: engine.aborted, what="the engine's abort", idle_s=10, poll_s=0.01)
        assert engine.aborted == ["r_1"]
        await until(lambda: len(ledger.marked), lambda n: n == 2, what="both noted", idle_s=10)
    finally:
        listening.cancel()
        await closed(worker)


async def test_a_background_task_failing_while_the_worker_stops_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its failure was dropped unsaid once the worker was stopping: a broken drain left
    nothing to go on."""
    worker = Worker(Settings(), MODEL, EngineOptions(model_dir=Path(".")))

    async def commit_loop() -> None:
        raise RuntimeError("Kafka refused the commit")

    worker.request_stop()
    failing = worker._watch(asyncio.create_task(commit_loop(), name="commit-loop"))
    try:
        with caplog.at_level(logging.WARNING, logger="workers.worker"):
            await asyncio.gather(failing, return_exceptions=True)
        assert "commit-loop failed while stopping" in caplog.text
        assert "Kafka refused the commit" in caplog.text and worker._failure is None
    finally:
        await closed(worker)
