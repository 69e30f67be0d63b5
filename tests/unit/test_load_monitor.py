"""The load monitor keeps measuring whatever a measurement raises: a poll that died would
leave its last figures in place for good (a gateway that saw no worker at its start
would refuse every prompt as 'no worker' from then on)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
from aiokafka.errors import KafkaConnectionError

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
    failing, calls = measurements(workers(0), RuntimeError("bug")), []

    async def counted(*args: object) -> Measured:
        calls.append(args)
        return await failing(*args)  # type: ignore[no-any-return]

    monkeypatch.setattr(model_load, "measure", counted)
    await monitor.start()
    try:  # a third measurement starts only once the second one's failure was handled
        await until(lambda: len(calls), lambda n: n >= 3, what="3 measurements", idle_s=2)
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


class Client:
    """A stand-in for aiokafka's admin client or consumer whose start may fail."""

    made: ClassVar[list[Client]] = []

    def __init__(self, **_: object) -> None:
        self.closed = False
        Client.made.append(self)

    async def start(self) -> None:
        if type(self).fails:
            raise KafkaConnectionError("Kafka refused the connection")

    async def stop(self) -> None:
        self.closed = True

    close = stop
    fails = False


class FailingConsumer(Client):
    fails = True


async def test_clients_whose_start_failed_are_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Retried every poll through an outage: each attempt left a client and its
    connections open."""
    Client.made = []
    monkeypatch.setattr(model_load, "AIOKafkaAdminClient", Client)
    monkeypatch.setattr(model_load, "AIOKafkaConsumer", FailingConsumer)
    for _ in range(3):
        with pytest.raises(KafkaConnectionError):
            async with model_load.backlog_clients(Settings()):
                pass
    assert len(Client.made) == 6 and all(client.closed for client in Client.made)


async def test_an_outage_is_not_counted_as_time_the_workers_finished_nothing(
    monitor: LoadMonitor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first measurement after Kafka came back was paired with the last before it:
    two minutes "full, nothing finished", and a minute of busy refusals after."""
    clock = [0.0]
    monkeypatch.setattr(model_load, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    slots = monitor.settings.models["m"].max_num_seqs
    done = [0]

    async def measure(*_: object) -> Measured:
        clock[0] += 1.0
        if 30 <= clock[0] < 150:
            raise KafkaConnectionError("Kafka is down")
        done[0] += 1
        return Measured(backlog={0: slots + 30}, done=done[0], workers=1)

    monkeypatch.setattr(model_load, "measure", measure)
    await monitor.start()
    try:
        await until(lambda: clock[0] >= 155, what="the clock", idle_s=5, poll_s=0.001)
    finally:
        await monitor.stop()
    load = monitor.load("m")
    assert load is not None and load.finished_per_s is None, load  # watched anew
