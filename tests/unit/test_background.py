"""Work nobody waits for, waited for at shutdown: a stop of a reply whose client left
went out after the gateway had closed its Kafka producer, and the reply ran on."""

from __future__ import annotations

import asyncio

from tandoor.background import Background


async def test_finish_waits_for_the_work_and_what_it_starts_meanwhile() -> None:
    background, done, go_on = Background(), [], asyncio.Event()

    async def then_more() -> None:
        await go_on.wait()
        background.start(record("second"))
        done.append("first")

    async def record(name: str) -> None:
        done.append(name)

    background.start(then_more())
    finishing = asyncio.ensure_future(background.finish(within_s=10))
    # Called after the finish's first step (scheduled before it): it waits on the first.
    asyncio.get_running_loop().call_soon(go_on.set)
    await finishing
    assert done == ["first", "second"] and len(background) == 0


async def test_finish_cancels_what_outlasts_its_time() -> None:
    background, cancelled = Background(), asyncio.Event()

    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    background.start(forever())
    await background.finish(within_s=0.05)
    assert cancelled.is_set() and len(background) == 0
