"""How tests wait: until a condition holds, giving up only when nothing has changed for a
generous while. Machines differ several-fold in engine speed (AVX-512 against AVX2-only
CPUs, a GPU), so a fixed total would be tuned to one of them: a slow machine that keeps
making progress is waited for, a stalled one fails with what it was waiting for."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from contextlib import asynccontextmanager
from typing import TypeVar

T = TypeVar("T")

IDLE_S = 120.0  # without any change for this long, a wait has stalled
POLL_S = 0.25


async def eventually(
    probe: Callable[[], Awaitable[T]],
    done: Callable[[T], object] = bool,
    *,
    what: str,
    idle_s: float = IDLE_S,
    poll_s: float = POLL_S,
) -> T:
    """The first value of `await probe()` for which `done` holds. Each new value of the
    probe counts as progress; only `idle_s` without one fails the wait."""
    loop = asyncio.get_running_loop()
    previous: object = _NOTHING
    changed_at = loop.time()
    while True:
        value = await probe()
        if done(value):
            return value
        if value != previous:
            previous, changed_at = value, loop.time()
        elif loop.time() - changed_at > idle_s:
            raise AssertionError(f"no progress for {idle_s:.0f} s waiting for {what}: {value!r}")
        await asyncio.sleep(poll_s)


async def until(
    check: Callable[[], T],
    done: Callable[[T], object] = bool,
    *,
    what: str,
    idle_s: float = IDLE_S,
    poll_s: float = POLL_S,
) -> T:
    """eventually() for a check that needs no awaiting."""

    async def probe() -> T:
        return check()

    return await eventually(probe, done, what=what, idle_s=idle_s, poll_s=poll_s)


@asynccontextmanager
async def while_progressing(
    progress: Callable[[], Hashable], what: str, idle_s: float = IDLE_S
) -> AsyncIterator[None]:
    """Like asyncio.timeout, but its clock starts again whenever `progress()` changes: the
    body is cancelled only after `idle_s` in which nothing moved."""
    timeout = asyncio.timeout_at(asyncio.get_running_loop().time() + idle_s)
    try:
        async with timeout:
            watcher = asyncio.create_task(_watch(timeout.reschedule, progress, idle_s))
            try:
                yield
            finally:
                watcher.cancel()
    except TimeoutError as exc:
        if timeout.expired():
            raise AssertionError(f"no progress for {idle_s:.0f} s: {what}") from exc
        raise


async def _watch(
    reschedule: Callable[[float], None], progress: Callable[[], Hashable], idle_s: float
) -> None:
    loop = asyncio.get_running_loop()
    last = progress()
    while True:
        await asyncio.sleep(min(POLL_S, idle_s / 4))
        now = progress()
        if now != last:
            last = now
            reschedule(loop.time() + idle_s)


_NOTHING = object()
