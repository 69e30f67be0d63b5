"""The cap on a user's enqueued batch lines (its tier's `enqueued_batch_lines`): the
lines of its batches not yet answered, and a new batch's, at most. Admission holds a
tenant's lines while its quota holds the tenant back, and each partition's share of
its buffer is bounded: one free key that created batches on every partition filled
every share, and every other tenant's batches waited behind its own for hours.

Counted from what is stored (the user's batches of the last completion window, and
their answers), so nothing drifts after a crash; the count and the new batch's row are
taken under one lock per user on this replica (two replicas creating batches for one
user at the same moment may each pass once)."""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

from producers.gateway.batches.objects import COMPLETION_WINDOW, lines_waiting, utc_now
from producers.gateway.batches.store import Answered, BatchStore, StoredBatch
from producers.gateway.errors import ApiError
from tandoor.policies.api_keys import Principal
from tandoor.settings import TierPolicy

PARAM = "input_file_id"
RETRY_S = 60  # a batch's lines are answered in minutes, not seconds


class QueueCap:
    def __init__(
        self,
        batches: BatchStore,
        tiers: Mapping[str, TierPolicy],
        answered_of: Callable[[StoredBatch], Awaitable[Answered]],
    ) -> None:
        self._batches = batches
        self._tiers = tiers
        self._answered_of = answered_of
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()

    @contextlib.asynccontextmanager
    async def room_for(self, caller: Principal, lines: int) -> AsyncIterator[None]:
        """Held while the new batch is stored; a 400 for a batch larger than the cap,
        a 429 for one that fits only once some lines are answered."""
        cap = self._tiers[caller.tier].enqueued_batch_lines
        if lines > cap:
            raise ApiError(
                400,
                f"the batch has {lines} lines; tier {caller.tier!r} may have at most {cap} "
                "lines of its batches waiting: split it",
                param=PARAM,
            )
        lock = self._locks.setdefault(caller.user_id, asyncio.Lock())
        async with lock:
            waiting = await self.waiting(caller.user_id)
            if waiting + lines > cap:
                raise ApiError(
                    429,
                    f"{waiting} lines of your batches are not answered yet, and tier "
                    f"{caller.tier!r} may have at most {cap} waiting: this batch's {lines} "
                    f"fit once {waiting + lines - cap} more are answered",
                    kind="rate_limit_error",
                    param=PARAM,
                    headers={"Retry-After": str(RETRY_S)},
                    code="rate_limit_exceeded",
                )
            yield

    async def waiting(self, user_id: str) -> int:
        """The lines of the user's batches not yet answered. Older batches than the
        completion window are expired or done: not read."""
        total = 0
        async for ids in self._batches.created_since(user_id, utc_now() - COMPLETION_WINDOW):
            found = await asyncio.gather(*(self._batches.get(i) for i in ids))
            total += sum(await asyncio.gather(*(self._waiting(b) for b in found if b)))
        return total

    async def _waiting(self, batch: StoredBatch) -> int:
        if batch.settled is not None:
            return 0
        return lines_waiting(batch, await self._answered_of(batch))
