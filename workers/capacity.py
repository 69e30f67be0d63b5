"""How much a worker may hold: sequences in flight, and their prompt plus new tokens."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Capacity:
    def __init__(self, max_seqs: int, max_tokens: int) -> None:
        self.max_seqs = max_seqs
        self.max_tokens = max_tokens
        self.seqs = 0
        self.tokens = 0
        self._changed = asyncio.Condition()

    @property
    def free_seqs(self) -> int:
        return max(0, self.max_seqs - self.seqs)

    def take_seq(self) -> None:
        self.seqs += 1

    async def release_seq(self) -> None:
        self.seqs -= 1
        await self.wake()

    async def wait_for_free_seq(self) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.free_seqs > 0)

    async def reserve_tokens(self, count: int, give_up: Callable[[], bool]) -> bool:
        """Wait until `count` tokens fit (anything fits an idle worker); False if
        `give_up` became true first (the request was cancelled while waiting)."""
        async with self._changed:
            await self._changed.wait_for(lambda: give_up() or self._fits(count))
            if give_up():
                return False
            self.tokens += count
            return True

    async def release_tokens(self, count: int) -> None:
        self.tokens -= count
        await self.wake()

    async def wake(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _fits(self, count: int) -> bool:
        return self.tokens == 0 or self.tokens + count <= self.max_tokens
