"""The tests' waits: a slow but moving condition is waited for, a stalled one fails."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from tests.waiting import eventually, until, while_progressing


async def test_a_slow_condition_that_keeps_moving_is_waited_for() -> None:
    counter = itertools.count()
    # 40 polls of 10 ms, far longer than the 50 ms idle limit, but each one is new.
    value = await until(
        lambda: next(counter), lambda n: n >= 40, what="40", idle_s=0.05, poll_s=0.01
    )
    assert value == 40


async def test_a_stalled_condition_fails_naming_what_it_waited_for() -> None:
    async def stuck() -> int:
        return 7

    with pytest.raises(AssertionError, match=r"no progress .* the answer: 7"):
        await eventually(stuck, lambda n: n == 8, what="the answer", idle_s=0.05, poll_s=0.01)


async def test_while_progressing_outlasts_its_idle_limit_while_things_move() -> None:
    moved = [0]
    async with while_progressing(lambda: moved[0], "moving", idle_s=0.5):
        for _ in range(50):  # the body's work: 1.5 s in all, three idle limits
            await asyncio.sleep(0.03)
            moved[0] += 1


async def test_while_progressing_cancels_a_stalled_body() -> None:
    with pytest.raises(AssertionError, match="no progress for 0 s: stalled"):
        async with while_progressing(lambda: 0, "stalled", idle_s=0.1):
            await asyncio.sleep(10)


async def test_while_progressing_keeps_other_timeouts_apart() -> None:
    with pytest.raises(TimeoutError):
        async with while_progressing(lambda: 0, "never reached", idle_s=10):
            async with asyncio.timeout(0.01):
                await asyncio.sleep(1)
