"""How much a worker may hold: sequences in flight, and their prompt plus new tokens."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence


class Capacity:
    def __init__(
        self, max_seqs: int, max_tokens: int, bands: Sequence[str] = (), top_share: float = 0.0
    ) -> None:
        """`bands`: highest priority first; freed tokens go to a higher band's waiter.
        `top_share`: of the tokens, what lower bands leave to the top band, as the
        scheduler leaves it a share of the slots (a flood of long batch lines took every
        token, and a top-band prompt given a kept slot waited for a batch reply to end)."""
        self.max_seqs = max_seqs
        self.max_tokens = max_tokens
        self.seqs = 0
        self.tokens = 0
        self.lower_tokens = 0  # held by bands below the top one
        self._lower_cap = max_tokens - round(max_tokens * top_share)
        self._changed = asyncio.Condition()
        self._rank = {band: rank for rank, band in enumerate(bands)}
        self._waiting: Counter[tuple[int, int]] = Counter()  # token waiters: (rank, count)
        self._taking_back = 0  # prompts waiting to take a slot back: they go first
        self._wakes: set[asyncio.Future[None]] = set()

    @property
    def free_seqs(self) -> int:
        return max(0, self.max_seqs - self.seqs)

    @property
    def free_for_new(self) -> int:
        """Free slots past the ones prompts wait to take back: the intake, back at once
        from each fetch, took every slot freed before a woken waiter could."""
        return max(0, self.free_seqs - self._taking_back)

    def take_seq(self, count: int = 1) -> None:
        self.seqs += count

    async def release_seq(self, count: int = 1) -> None:
        self.seqs -= count
        await self.wake()

    async def wait_for_free_seq(
        self,
        give_up: Callable[[], bool] = lambda: False,
        wake_in_s: float | None = None,
        new: bool = False,
    ) -> bool:
        """Until a slot is free (True; for a `new` prompt, one nobody waits to take back),
        or `give_up` became true first (False; looked at on each wake, and `wake_in_s`
        from now)."""

        def free() -> int:
            return self.free_for_new if new else self.free_seqs

        with self._woken_in(wake_in_s):
            async with self._changed:
                await self._changed.wait_for(lambda: free() > 0 or give_up())
        return not give_up()

    async def take_seq_back(
        self, give_up: Callable[[], bool] = lambda: False, wake_in_s: float | None = None
    ) -> bool:
        """A slot for a prompt that gave its own back, ahead of new prompts: held (True),
        or not, as `give_up` became true first (False)."""
        self._taking_back += 1
        taken = False
        try:
            taken = await self.wait_for_free_seq(give_up, wake_in_s)
        finally:
            self._taking_back -= 1
            if not taken:  # gave up: the slot kept for it may go to a new prompt now
                self._wake_soon()
        if taken:
            self.take_seq()
        return taken

    async def reserve_tokens(
        self,
        count: int,
        give_up: Callable[[], bool],
        band: str | None = None,
        wake_in_s: float | None = None,
    ) -> bool:
        """Wait until `count` tokens fit (anything fits an idle worker) and no waiter of
        a higher band would fit in the room first; False if `give_up` became true first
        (the request was cancelled while waiting, or its deadline passed: `wake_in_s`
        looks again then, when no release may come for minutes). A higher band's waiter
        too big for the room holds back nobody: lower bands keep the share of slots
        they are given."""
        waiter = (self._rank_of(band), count)
        with self._woken_in(wake_in_s):
            return await self._reserve(count, give_up, waiter)

    @contextlib.contextmanager
    def _woken_in(self, wake_in_s: float | None) -> Iterator[None]:
        """Waiters look again `wake_in_s` from now (a deadline no release may come by)."""
        if wake_in_s is None:
            yield
            return
        timer = asyncio.get_running_loop().call_later(max(0.0, wake_in_s), self._wake_soon)
        try:
            yield
        finally:
            timer.cancel()

    async def _reserve(
        self, count: int, give_up: Callable[[], bool], waiter: tuple[int, int]
    ) -> bool:
        async with self._changed:
            self._waiting[waiter] += 1
            try:
                await self._changed.wait_for(
                    lambda: (
                        give_up()
                        or (self._fits(count, waiter[0]) and not self._ahead_of(waiter[0]))
                    )
                )
            finally:
                self._waiting[waiter] -= 1
                if not self._waiting[waiter]:  # else kept for good, and scanned by each check
                    del self._waiting[waiter]
                self._changed.notify_all()  # a waiter behind this one may go now
            if give_up():
                return False
            self.tokens += count
            if waiter[0] > 0:
                self.lower_tokens += count
            return True

    def _ahead_of(self, rank: int) -> bool:
        return any(
            waiting > 0 and other < rank and self._fits(count, other)
            for (other, count), waiting in self._waiting.items()
        )

    async def release_tokens(self, count: int, band: str | None) -> None:
        self.tokens -= count
        if self._rank_of(band) > 0:
            self.lower_tokens -= count
        await self.wake()

    async def wake(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _wake_soon(self) -> None:
        task = asyncio.ensure_future(self.wake())
        self._wakes.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._wakes.discard)

    def _rank_of(self, band: str | None) -> int:
        return self._rank.get(band or "", len(self._rank))

    def _fits(self, count: int, rank: int) -> bool:
        """Anything fits an idle worker; a lower band's first reservation may pass its
        share, as the only one of its bands running."""
        if self.tokens == 0:
            return True
        if self.tokens + count > self.max_tokens:
            return False
        lower_fits = self.lower_tokens == 0 or self.lower_tokens + count <= self._lower_cap
        return rank == 0 or lower_fits
