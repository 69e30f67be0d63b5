"""How a stopping worker waits for what is in flight: until it all finishes, the grace
period ends, or a second stop signal says not to wait (Ctrl-C pressed again, as a
stuck reply held `tandoor worker` for its whole grace period)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from tandoor.clients import redis_client
from tandoor.settings import Settings
from tests.unit.test_worker_start import MODEL, closed
from workers.attempt import Tracked
from workers.engine import EngineOptions
from workers.worker import Worker, unfinished


async def forever() -> None:
    await asyncio.Event().wait()


async def test_finished_prompts_end_the_wait_before_the_grace_period() -> None:
    quick = asyncio.create_task(asyncio.sleep(0))
    assert await unfinished({quick}, grace_s=3600, hurry=asyncio.Event()) == set()


async def test_a_second_stop_ends_the_wait_and_leaves_the_prompts_running() -> None:
    stuck = asyncio.create_task(forever())
    hurry = asyncio.Event()
    asyncio.get_running_loop().call_soon(hurry.set)
    assert await unfinished({stuck}, grace_s=3600, hurry=hurry) == {stuck}
    assert not stuck.done()  # handed back by the worker, not cancelled by the wait
    stuck.cancel()


async def test_the_grace_period_ends_the_wait() -> None:
    stuck = asyncio.create_task(forever())
    assert await unfinished({stuck}, grace_s=0.01, hurry=asyncio.Event()) == {stuck}
    assert not stuck.done()
    stuck.cancel()


async def test_nothing_in_flight_is_no_wait() -> None:
    assert await unfinished(set(), grace_s=3600, hurry=asyncio.Event()) == set()


async def test_the_second_stop_signal_is_the_one_that_hurries() -> None:
    worker = Worker(Settings(worker_metrics_port=0), MODEL, EngineOptions(model_dir=Path(".")))
    try:
        worker.request_stop()  # SIGTERM: the grace period
        assert not worker._hurry.is_set()
        worker.request_stop()  # Ctrl-C again
        assert worker._hurry.is_set()
    finally:
        await closed(worker)


class Answering:
    def __init__(self, up: bool) -> None:
        self.up = up

    async def ping(self) -> bool:
        if not self.up:
            raise RedisConnectionError("Redis is down")
        return True


@pytest.mark.parametrize(
    ("leased", "attempt", "redis_up", "leaves"),
    [
        (True, 1, True, True),  # running under its lease: the next owner waits on it
        (False, 0, True, True),  # fetched, not yet arrived: it will take its lease
        (False, 1, True, False),  # run while Redis was down: it would run twice
        (False, 0, False, False),  # Redis down now: it would arrive unleased twice
    ],
)
async def test_a_stopping_worker_leaves_its_group_early_only_where_nothing_runs_twice(
    leased: bool, attempt: int, redis_up: bool, leaves: bool
) -> None:
    worker = Worker(Settings(worker_metrics_port=0), MODEL, EngineOptions(model_dir=Path(".")))
    try:
        worker._tracked["r"] = Tracked("r", leased=leased, attempt=attempt)
        worker._redis = cast(Any, Answering(redis_up))
        assert await worker._all_leasable() is leaves
    finally:
        worker._redis = redis_client(worker.settings)
        await closed(worker)
