"""The cap on a user's enqueued batch lines, counted from stored batches (a stand-in
store here; tests/integration/test_batch_queue_cap.py runs it through the gateway with
admission, persistence and a worker)."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest

from producers.gateway.batches.enqueued import QueueCap
from producers.gateway.batches.objects import COMPLETION_WINDOW, utc_now
from producers.gateway.batches.store import Answered, StoredBatch
from producers.gateway.errors import ApiError
from tandoor.policies.api_keys import Principal
from tandoor.settings import TierPolicy

TIERS = {
    "small": TierPolicy(
        band="batch",
        requests_per_minute=1,
        tokens_per_minute=1000,
        concurrent_streams=1,
        max_enqueued_batch_lines=10,
    ),
    "by-quota": TierPolicy(
        band="batch", requests_per_minute=7, tokens_per_minute=1000, concurrent_streams=1
    ),
}
CALLER = Principal("u1", "small", "k")


def batch(name: str, total: int, age: dt.timedelta = dt.timedelta(0), **kw: Any) -> StoredBatch:
    kw.setdefault("cancelled_at", None)
    created = utc_now() - age
    return StoredBatch(name, "u1", "f", "/v1/chat/completions", "24h", total, None, created, **kw)


class Batches:
    """The user's stored batches and the answers each has so far."""

    def __init__(self, *found: tuple[StoredBatch, int]) -> None:
        self.found = {b.batch_id: (b, answered) for b, answered in found}
        self.stored: list[str] = []

    async def created_since(self, user_id: str, since: dt.datetime) -> AsyncIterator[list[str]]:
        newest_first = sorted(self.found.values(), key=lambda f: f[0].created_at, reverse=True)
        yield [b.batch_id for b, _ in newest_first if b.created_at > since][:2]
        yield [b.batch_id for b, _ in newest_first if b.created_at > since][2:]

    async def get(self, batch_id: str) -> StoredBatch | None:
        return self.found[batch_id][0]

    async def answered(self, batch: StoredBatch) -> Answered:
        return Answered(succeeded=self.found[batch.batch_id][1])


def cap(batches: Batches) -> QueueCap:
    return QueueCap(cast(Any, batches), TIERS, batches.answered)


async def test_only_lines_not_yet_answered_of_batches_that_may_still_run_count() -> None:
    batches = Batches(
        (batch("running", 5), 2),  # 3 waiting
        (batch("new", 4), 0),  # 4
        (batch("done", 6), 6),
        (batch("settled", 9, settled=Answered(9)), 0),
        (batch("cancelled", 8, cancelled_at=utc_now()), 8),
        (batch("cancelling", 8, cancelled_at=utc_now()), 6),  # 2
        (batch("expired", 7, COMPLETION_WINDOW + dt.timedelta(minutes=1)), 0),
        (batch("interrupted", 5, dt.timedelta(hours=1), queuing=True), 0),
    )
    assert await cap(batches).waiting("u1") == 9


async def test_a_batch_past_the_room_left_is_a_429_and_one_past_the_cap_a_400() -> None:
    batches = Batches((batch("running", 5), 2))  # 3 of 10 waiting
    async with cap(batches).room_for(CALLER, 7):
        pass
    with pytest.raises(ApiError) as later:
        async with cap(batches).room_for(CALLER, 8):
            pass
    assert later.value.status == 429 and later.value.headers["Retry-After"]
    assert "3 lines of your batches" in later.value.message and "1 more" in later.value.message
    with pytest.raises(ApiError) as never:
        async with cap(batches).room_for(CALLER, 11):
            pass
    assert never.value.status == 400 and "split it" in never.value.message


async def test_without_a_cap_a_tier_may_queue_what_its_request_quota_runs_in_an_hour() -> None:
    by_quota = Principal("u1", "by-quota", "k")
    async with cap(Batches()).room_for(by_quota, 7 * 60):
        pass
    with pytest.raises(ApiError):
        async with cap(Batches()).room_for(by_quota, 7 * 60 + 1):
            pass


async def test_two_creates_for_one_user_are_counted_one_after_the_other() -> None:
    """Each held room for its batch until stored: counted at once, both passed."""
    batches = Batches()
    queue_cap = cap(batches)

    async def create(name: str) -> str:
        async with queue_cap.room_for(CALLER, 6):
            await asyncio.sleep(0)  # the batch's row is written meanwhile
            batches.found[name] = (batch(name, 6), 0)
        return name

    outcomes = await asyncio.gather(create("a"), create("b"), return_exceptions=True)
    assert sorted(map(type, outcomes), key=str) == sorted([str, ApiError], key=str)
