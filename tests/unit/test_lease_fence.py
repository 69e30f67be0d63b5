"""A worker that cannot reach Redis past its lease publishes nothing until Redis says
whose the lease is (workers/recording.py `fenced`; tests/integration/test_ledger.py
has a worker cut off from a real Redis): pure logic, a stand-in for the ledger."""

from __future__ import annotations

import asyncio
from typing import cast

import pytest

from tests.unit.test_transcript_records import attempt
from tests.waiting import until
from workers import recording
from workers.attempt import LeaseLost
from workers.lease_clock import LeaseClock
from workers.ledger import RequestLedger


class RedisAway:
    """Out of reach for good; the lease last confirmed long ago."""

    def __init__(self) -> None:
        self.leases = LeaseClock(lease_s=10.0)
        self.asked = 0

    async def holds(self, request_id: str, attempt: int) -> str:
        self.asked += 1
        return "down"


async def test_a_reply_cancelled_while_it_waits_for_redis_ends_unpublished(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It waited for Redis with its engine slot and token budget held, whatever its
    client did: a cancel (its OpenAI client left, its gateway gave up) changed nothing
    for as long as Redis stayed away."""
    monkeypatch.setattr(recording, "FENCE_ASK_S", 0.01)
    ledger, waiting = RedisAway(), attempt()
    fenced = asyncio.create_task(recording.fenced(cast(RequestLedger, ledger), waiting))
    try:
        await until(lambda: ledger.asked >= 2, what="the lease asked about, twice")
        assert not fenced.done(), "published while its lease could be another worker's"
        waiting.tracked.cancelled = True
        with pytest.raises(LeaseLost):
            await asyncio.wait_for(fenced, 10)
    finally:
        fenced.cancel()
