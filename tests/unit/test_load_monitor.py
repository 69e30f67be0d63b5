"""The load monitor keeps measuring whatever a measurement raises: a poll that died would
leave its last figures in place for good (a gateway that saw no worker at its start
would refuse every prompt as 'no worker' from then on)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest

from producers import model_load
from producers.model_load import LoadMonitor, Measured
from tandoor.models import ModelConfig
from tandoor.settings import Settings
from tests.waiting import until

POLL_S = 0.01


@asynccontextmanager
async def no_clients(settings: Settings) -> AsyncIterator[tuple[Any, Any]]:
    yield None, None


def measurements(*outcomes: Measured | Exception) -> Callable[..., Any]:
    """A measure() giving `outcomes` in turn, then the last one again."""
    seen = list(outcomes)

    async def measure(*_: object) -> Measured:
        outcome = seen.pop(0) if len(seen) > 1 else seen[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    return measure


def workers(count: int) -> Measured:
    return Measured(backlog={0: 0}, done=0, workers=count)


def sees_workers(monitor: LoadMonitor, count: int) -> Callable[[], bool]:
    return lambda: (load := monitor.load("m")) is not None and load.workers == count


@pytest.fixture
def monitor(monkeypatch: pytest.MonkeyPatch) -> LoadMonitor:
    monkeypatch.setattr(model_load, "backlog_clients", no_clients)
    settings = Settings(models={"m": ModelConfig(source="/models/m")})
    return LoadMonitor(settings, poll_s=POLL_S)


@pytest.mark.parametrize(
    "unexpected", [RuntimeError("bug"), ValueError("bad response"), AssertionError("state")]
)
async def test_an_unexpected_error_makes_the_load_unknown_and_polling_goes_on(
    monitor: LoadMonitor, monkeypatch: pytest.MonkeyPatch, unexpected: Exception
) -> None:
    monkeypatch.setattr(model_load, "measure", measurements(workers(0), unexpected, workers(1)))
    await monitor.start()
    try:
        await until(sees_workers(monitor, 1), what="1 workers", idle_s=2)
    finally:
        await monitor.stop()


async def test_the_load_is_unknown_while_measuring_fails(
    monitor: LoadMonitor, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(model_load, "measure", measurements(workers(0), RuntimeError("bug")))
    await monitor.start()
    try:
        await asyncio.sleep(POLL_S * 20)
        assert monitor.load("m") is None  # never the stale "no worker"
    finally:
        await monitor.stop()


async def test_clients_that_cannot_start_are_tried_again(
    monitor: LoadMonitor, monkeypatch: pytest.MonkeyPatch
) -> None:
    starts: list[int] = []

    @asynccontextmanager
    async def flaky_clients(settings: Settings) -> AsyncIterator[tuple[Any, Any]]:
        starts.append(1)
        if len(starts) == 1:
            raise OSError("Kafka refused the connection")
        yield None, None

    monkeypatch.setattr(model_load, "backlog_clients", flaky_clients)
    monkeypatch.setattr(model_load, "measure", measurements(workers(2)))
    await monitor.start()
    try:
        await until(sees_workers(monitor, 2), what="2 workers", idle_s=2)
    finally:
        await monitor.stop()
