from __future__ import annotations

import asyncio

from workers.capacity import Capacity


async def test_token_budget_waits_until_enough_is_released() -> None:
    capacity = Capacity(max_seqs=4, max_tokens=100)
    assert await capacity.reserve_tokens(80, give_up=lambda: False)
    waiter = asyncio.create_task(capacity.reserve_tokens(30, give_up=lambda: False))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    await capacity.release_tokens(80)
    assert await asyncio.wait_for(waiter, 1)
    assert capacity.tokens == 30


async def test_an_oversized_request_still_runs_on_an_idle_worker() -> None:
    capacity = Capacity(max_seqs=1, max_tokens=10)
    assert await capacity.reserve_tokens(500, give_up=lambda: False)


async def test_a_cancelled_waiter_gives_up() -> None:
    capacity = Capacity(max_seqs=4, max_tokens=10)
    await capacity.reserve_tokens(10, give_up=lambda: False)
    cancelled = False
    waiter = asyncio.create_task(capacity.reserve_tokens(5, give_up=lambda: cancelled))
    await asyncio.sleep(0.01)
    cancelled = True
    await capacity.wake()
    assert await asyncio.wait_for(waiter, 1) is False
    assert capacity.tokens == 10


async def test_sequence_slots() -> None:
    capacity = Capacity(max_seqs=2, max_tokens=10)
    capacity.take_seq()
    capacity.take_seq()
    assert capacity.free_seqs == 0
    waiter = asyncio.create_task(capacity.wait_for_free_seq())
    await asyncio.sleep(0.01)
    assert not waiter.done()
    await capacity.release_seq()
    await asyncio.wait_for(waiter, 1)
