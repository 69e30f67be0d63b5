"""A background task a role cannot live without that dies is reported: the role turns
unready and stops (tandoor.lifecycle.fatal), instead of going on without it."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator

import pytest

from consumers.fanout import TokenFanout
from tandoor import lifecycle
from tandoor.settings import Settings


@pytest.fixture
async def fanout(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[TokenFanout]:
    """A fan-out never started; fatal() records, and its SIGTERM is caught."""
    monkeypatch.setattr(lifecycle, "_fatal", [])
    made = TokenFanout(Settings())
    yield made
    await made._consumer.stop()


async def test_a_dead_token_fanout_makes_the_gateway_unready_and_stop(
    fanout: TokenFanout, monkeypatch: pytest.MonkeyPatch
) -> None:
    raised: list[int] = []
    monkeypatch.setattr(signal, "raise_signal", raised.append)
    fanout._ready.set()  # it had partitions
    assert fanout.ready

    async def dies() -> None:
        raise RuntimeError("broker gone for good")

    task = asyncio.create_task(dies())
    task.add_done_callback(fanout._dispatch_ended)
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(0)  # done callbacks run on the next turn of the loop
    assert not fanout.ready
    assert raised == [signal.SIGTERM]
    with pytest.raises(SystemExit, match="broker gone for good"):
        lifecycle.exit_if_fatal()


async def test_a_cancelled_fanout_is_no_failure(
    fanout: TokenFanout, monkeypatch: pytest.MonkeyPatch
) -> None:
    raised: list[int] = []
    monkeypatch.setattr(signal, "raise_signal", raised.append)
    task = asyncio.create_task(asyncio.sleep(60))
    task.add_done_callback(fanout._dispatch_ended)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(0)
    assert fanout.failure is None and raised == []
    lifecycle.exit_if_fatal()
