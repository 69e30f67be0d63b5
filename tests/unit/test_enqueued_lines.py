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
from producers.gateway.batches.records import Answered, StoredBatch
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

    async def answered_count(self, user_id: str, batch_id: str) -> int:
        return self.found[batch_id][1]


def cap(batches: Batches) -> QueueCap:
    return QueueCap(cast(Any, batches), TIERS)


async def room_for(queue_cap: QueueCap, caller: Principal, lines: int) -> None:
    async with queue_cap.room(caller) as room:
        room.take(lines)


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
        (batch("queuing", 4, queuing=True), 0),  # 4: its lines may still be committed
    )
    assert await cap(batches).waiting("u1") == 13


async def test_a_batch_past_the_room_left_is_a_429_and_one_past_the_cap_a_400() -> None:
    batches = Batches((batch("running", 5), 2))  # 3 of 10 waiting
    await room_for(cap(batches), CALLER, 7)
    with pytest.raises(ApiError) as later:
        await room_for(cap(batches), CALLER, 8)
    assert later.value.status == 429 and later.value.headers["Retry-After"]
    assert "3 lines of your batches" in later.value.message and "1 more" in later.value.message
    with pytest.raises(ApiError) as never:
        await room_for(cap(batches), CALLER, 11)
    assert never.value.status == 400 and "split it" in never.value.message


async def test_a_user_with_no_room_left_is_told_before_its_file_is_read() -> None:
    """Counted only after its file was parsed, while holding one of the replica's two
    create turns: a client retrying its 429s kept other users' creates waiting."""
    full = Batches((batch("running", 10), 0))
    with pytest.raises(ApiError) as refused:
        async with cap(full).room(CALLER):
            raise AssertionError("a create went on with no room")
    assert refused.value.status == 429 and "10 lines" in refused.value.message


async def test_without_a_cap_a_tier_may_queue_what_its_request_quota_runs_in_an_hour() -> None:
    by_quota = Principal("u1", "by-quota", "k")
    await room_for(cap(Batches()), by_quota, 7 * 60)
    with pytest.raises(ApiError):
        await room_for(cap(Batches()), by_quota, 7 * 60 + 1)


async def test_two_creates_for_one_user_are_counted_one_after_the_other() -> None:
    """Each held room for its batch until stored: counted at once, both passed."""
    batches = Batches()
    queue_cap = cap(batches)

    async def create(name: str) -> str:
        async with queue_cap.room(CALLER) as room:
            await asyncio.sleep(0)  # its file is read meanwhile
            room.take(6)
            batches.found[name] = (batch(name, 6), 0)
        return name

    outcomes = await asyncio.gather(create("a"), create("b"), return_exceptions=True)
    assert sorted(map(type, outcomes), key=str) == sorted([str, ApiError], key=str)
