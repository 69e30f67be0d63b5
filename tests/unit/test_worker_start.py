"""A worker's start-up, which loads its engine for minutes: what is checked before, and
a stop asked for meanwhile (a scale-down of a pod still loading, Ctrl-C)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from tandoor.settings import Settings
from workers.engine import EngineOptions
from workers.worker import Worker

MODEL = "smollm2"


class LoadedEngine:
    healthy = True
    cache_tokens = None  # its cache size unknown: nothing said

    async def shutdown(self) -> None:
        return None


async def closed(worker: Worker) -> None:
    await worker.close()
    await worker._producer.stop()  # made on creation; stopping an unstarted one is safe
    await worker.intake.consumer.stop()
    await worker.control.stop()


async def test_a_taken_ops_port_stops_the_worker_before_its_engine_loads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It was bound last: minutes of loading, a join of the group (a rebalance for every
    worker of the model), then a traceback, and a second rebalance on the way out."""
    loaded: list[str] = []

    async def load(options: Any) -> LoadedEngine:
        loaded.append("engine")
        return LoadedEngine()

    monkeypatch.setattr("workers.worker.Engine.start", load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        settings = Settings(worker_metrics_port=port)
        worker = Worker(settings, MODEL, EngineOptions(model_dir=Path(".")))
        try:
            with pytest.raises(SystemExit, match=f"port {port}"):
                await worker.start()
        finally:
            await closed(worker)
    assert loaded == []


async def test_a_stop_asked_while_the_engine_loads_joins_no_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SIGTERM only set a flag: once loaded the worker joined the group, said "ready",
    and only then left, two rebalances for every worker of the model."""
    worker = Worker(Settings(worker_metrics_port=0), MODEL, EngineOptions(model_dir=Path(".")))
    joined: list[str] = []

    async def load(options: Any) -> LoadedEngine:
        worker.request_stop()  # SIGTERM meanwhile
        return LoadedEngine()

    async def join() -> None:
        joined.append("intake")

    monkeypatch.setattr("workers.worker.Engine.start", load)
    monkeypatch.setattr(worker.intake, "start", join)
    try:
        await worker.start()
        await worker.run()  # returns at once: nothing taken, nothing to hand back
    finally:
        await closed(worker)
    assert joined == []
