from __future__ import annotations

import asyncio

from tests.waiting import until
from workers.capacity import Capacity


async def settle() -> None:
    """Let every task run until it waits (one loop, no I/O: no clock involved)."""
    for _ in range(10):
        await asyncio.sleep(0)


async def test_token_budget_waits_until_enough_is_released() -> None:
    capacity = Capacity(max_seqs=4, max_tokens=100)
    assert await capacity.reserve_tokens(80, give_up=lambda: False)
    waiter = asyncio.create_task(capacity.reserve_tokens(30, give_up=lambda: False))
    await settle()
    assert not waiter.done()
    await capacity.release_tokens(80, None)
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
    await settle()
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
    await settle()
    assert not waiter.done()
    await capacity.release_seq()
    await asyncio.wait_for(waiter, 1)


async def test_freed_tokens_go_to_a_waiter_of_a_higher_band_first() -> None:
    """Waiters took freed room in the order they came: a batch prompt waiting since
    before an interactive one took the room the interactive one needed, and again at
    the next release, however long the interactive one had waited."""
    capacity = Capacity(max_seqs=8, max_tokens=100, bands=["interactive", "batch"])
    assert await capacity.reserve_tokens(60, give_up=lambda: False, band="batch")
    batch = asyncio.create_task(capacity.reserve_tokens(60, lambda: False, band="batch"))
    await settle()
    chat = asyncio.create_task(capacity.reserve_tokens(50, lambda: False, band="interactive"))
    await settle()
    await capacity.release_tokens(60, "batch")
    assert await asyncio.wait_for(chat, 1)
    await settle()
    assert not batch.done(), "the batch prompt took room with the interactive one waiting"
    await capacity.release_tokens(50, "interactive")
    assert await asyncio.wait_for(batch, 1)


async def test_a_higher_band_waiter_too_big_for_the_room_holds_back_nobody() -> None:
    """Lower bands hold the slots the scheduler gives them: blocked behind a prompt that
    cannot fit yet, they would sit on them without running."""
    capacity = Capacity(max_seqs=8, max_tokens=100, bands=["interactive", "batch"])
    assert await capacity.reserve_tokens(60, give_up=lambda: False, band="batch")
    stopped = False
    chat = asyncio.create_task(capacity.reserve_tokens(80, lambda: stopped, band="interactive"))
    await settle()
    assert await asyncio.wait_for(capacity.reserve_tokens(30, lambda: False, band="batch"), 1)
    stopped = True
    await capacity.wake()
    assert await asyncio.wait_for(chat, 1) is False
    assert capacity.tokens == 90


async def test_a_waiter_past_its_deadline_gives_up_without_being_woken() -> None:
    """Nobody releases tokens (long replies run): the queued prompt still ends at its
    deadline, not whenever room frees up, minutes later."""
    capacity = Capacity(max_seqs=4, max_tokens=10)
    await capacity.reserve_tokens(10, give_up=lambda: False)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 0.05
    waiter = asyncio.create_task(
        capacity.reserve_tokens(5, give_up=lambda: loop.time() > deadline, wake_in_s=0.05)
    )
    assert await asyncio.wait_for(waiter, 5) is False
    assert capacity.tokens == 10


async def test_nothing_is_kept_for_waiters_that_have_gone() -> None:
    """Every waiter's (band, size) was kept at zero once it went: up to bands x context
    length entries, each scanned by every later budget check."""
    capacity = Capacity(max_seqs=4, max_tokens=10)
    await capacity.reserve_tokens(10, give_up=lambda: False)
    stopped = False
    waiters = [
        asyncio.create_task(capacity.reserve_tokens(size, give_up=lambda: stopped))
        for size in range(1, 200)
    ]
    await settle()
    stopped = True  # stopped by their users, say
    await capacity.wake()
    assert await asyncio.wait_for(asyncio.gather(*waiters), 5) == [False] * 199
    assert not capacity._waiting


async def test_lower_bands_leave_the_top_band_its_share_of_the_tokens() -> None:
    """Slots were kept for the top band, tokens not: batch lines of 2,048 tokens each
    took 38,912 of 40,000, and a chat prompt given a kept slot waited minutes for a
    batch reply to end."""
    bands = ["interactive-paid", "batch"]
    capacity = Capacity(max_seqs=32, max_tokens=40_000, bands=bands, top_share=0.25)
    lines = [
        asyncio.create_task(capacity.reserve_tokens(2048, lambda: False, band="batch"))
        for _ in range(19)
    ]
    await settle()
    assert sum(line.done() for line in lines) == 14  # 28,672 of the 30,000 left to them
    chat = capacity.reserve_tokens(1500, lambda: False, band="interactive-paid")
    assert await asyncio.wait_for(chat, 5)
    await capacity.release_tokens(1500, "interactive-paid")
    await capacity.release_tokens(2048, "batch")
    await settle()
    assert sum(line.done() for line in lines) == 15, "a batch line takes the room freed"
    for line in lines:
        line.cancel()


async def test_a_slot_kept_for_a_prompt_that_stops_waiting_goes_to_a_new_one() -> None:
    """A prompt waiting to take its slot back keeps a freed slot from new prompts. Freed
    as it stopped waiting (cancelled, past its deadline), the intake looked first, saw
    the slot kept, and slept on it until its next poll (30 s): nothing woke it again."""
    capacity = Capacity(max_seqs=1, max_tokens=1000)
    capacity.take_seq()
    new_prompt = asyncio.create_task(capacity.wait_for_free_seq(new=True))  # the intake
    await until(lambda: len(capacity._changed._waiters), lambda n: n == 1, what="the intake")
    stopped = False
    taking_back = asyncio.create_task(capacity.take_seq_back(lambda: stopped))
    await until(lambda: len(capacity._changed._waiters), lambda n: n == 2, what="the prompt")
    stopped = True  # its deadline passes as a reply ends
    await capacity.release_seq()
    assert await asyncio.wait_for(taking_back, 10) is False
    assert await asyncio.wait_for(new_prompt, 10) is True  # woken, not left asleep
