"""The cap on a user's enqueued batch lines (its tier's `enqueued_batch_lines`): the
lines of its batches not yet answered, and a new batch's, at most. Admission holds a
tenant's lines while its quota holds the tenant back, and each partition's share of
its buffer is bounded: one free key that created batches on every partition filled
every share, and every other tenant's batches waited behind its own for hours.

Counted from what is stored (the user's batches of the last completion window, and how
many of each one's lines are answered), so nothing drifts after a crash. A user is
counted before its file is read or a create's turn taken (one with no room left is
told at once), and counted and its batch stored under one lock per user on this
replica (two replicas creating batches for one user at the same moment may each pass
once)."""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

from producers.gateway.batches.objects import COMPLETION_WINDOW, lines_waiting, utc_now
from producers.gateway.batches.records import StoredBatch
from producers.gateway.batches.store import BatchStore
from producers.gateway.errors import ApiError
from tandoor.policies.api_keys import Principal
from tandoor.settings import TierPolicy

PARAM = "input_file_id"
RETRY_S = 60  # a batch's lines are answered in minutes, not seconds


@dataclass(frozen=True)
class Room:
    """What a user may still queue, counted when its create began."""

    tier: str
    cap: int
    waiting: int

    def take(self, lines: int) -> None:
        """A 400 for a batch larger than the cap, a 429 for one that fits only once some
        lines are answered."""
        if lines > self.cap:
            raise ApiError(
                400,
                f"the batch has {lines} lines; tier {self.tier!r} may have at most "
                f"{self.cap} lines of its batches waiting: split it",
                param=PARAM,
            )
        if self.waiting + lines > self.cap:
            more = self.waiting + lines - self.cap
            raise self.full(f"this batch's {lines} fit once {more} more are answered")

    def full(self, fits: str) -> ApiError:
        return ApiError(
            429,
            f"{self.waiting} lines of your batches are not answered yet, and tier "
            f"{self.tier!r} may have at most {self.cap} waiting: {fits}",
            kind="rate_limit_error",
            param=PARAM,
            headers={"Retry-After": str(RETRY_S)},
            code="rate_limit_exceeded",
        )


class QueueCap:
    def __init__(self, batches: BatchStore, tiers: Mapping[str, TierPolicy]) -> None:
        self._batches = batches
        self._tiers = tiers
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()

    @contextlib.asynccontextmanager
    async def room(self, caller: Principal) -> AsyncIterator[Room]:
        """Held until the new batch is stored; a 429 at once when nothing fits."""
        cap = self._tiers[caller.tier].enqueued_batch_lines
        lock = self._locks.setdefault(caller.user_id, asyncio.Lock())
        async with lock:
            room = Room(caller.tier, cap, await self.waiting(caller.user_id))
            if room.waiting >= cap:
                raise room.full("a batch fits once some are answered")
            yield room

    async def waiting(self, user_id: str) -> int:
        """The lines of the user's batches not yet answered. Batches older than the
        completion window are expired or done: not read."""
        total = 0
        async for ids in self._batches.created_since(user_id, utc_now() - COMPLETION_WINDOW):
            found = await asyncio.gather(*(self._batches.get(i) for i in ids))
            total += sum(await asyncio.gather(*(self._waiting(b) for b in found if b)))
        return total

    async def _waiting(self, batch: StoredBatch) -> int:
        if batch.settled is not None:
            return 0
        answered = await self._batches.answered_count(batch.user_id, batch.batch_id)
        return lines_waiting(batch, answered)
