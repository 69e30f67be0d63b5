"""A batch cancelled over HTTP stays cancelled for admission when Redis restarts empty
(real Cassandra and Redis): its stored row is read, and its Redis mark put back."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import pytest
import redis.asyncio as aioredis

from producers.admission.marks import LineMarks
from producers.admission.stored_cancels import StoredCancels
from producers.gateway.batches.records import StoredBatch
from producers.gateway.batches.store import BatchStore
from tandoor.policies.redis_keys import batch_cancel_key

pytestmark = pytest.mark.integration

AT = dt.datetime(2026, 12, 1, 12, 0, 0)


async def stored_batch(store: BatchStore, owner: str, cancelled: bool) -> str:
    batch_id = f"b-{uuid.uuid4().hex}"
    made = StoredBatch(batch_id, owner, "f", "/v1/chat/completions", "24h", 3, None, AT, None)
    await store.create(made)
    if cancelled:
        await store.cancel(batch_id, AT)
    return batch_id


async def test_a_cancel_redis_lost_is_found_in_the_store_and_marked_again(
    session: Any, redis_url: str
) -> None:
    """Redis keeps nothing on disk: restarted, it had no mark, and the cancelled batch's
    waiting lines were forwarded, charged and run."""
    store, owner = BatchStore(session), f"u-{uuid.uuid4().hex[:8]}"
    cancelled = await stored_batch(store, owner, cancelled=True)  # its mark lost
    running = await stored_batch(store, owner, cancelled=False)
    redis = aioredis.Redis.from_url(redis_url)
    try:
        marks = LineMarks(redis, StoredCancels(session))
        asked = [(owner, cancelled), (owner, running), ("someone-else", cancelled)]
        assert await marks.cancelled_batches(asked) == {(owner, cancelled)}
        assert await redis.exists(batch_cancel_key(owner, cancelled)), "not marked again"
        assert not await redis.exists(batch_cancel_key(owner, running))
        assert not await LineMarks(redis).cancelled(owner, running)
    finally:
        await redis.aclose()


async def test_a_batch_found_not_cancelled_is_asked_about_again_only_later(session: Any) -> None:
    """Every sweep (each second) read every waiting batch's row: 20,000 waiting batches
    were 20,000 reads a second."""
    now = [0.0]
    store, owner = BatchStore(session), f"u-{uuid.uuid4().hex[:8]}"
    batch_id = await stored_batch(store, owner, cancelled=False)
    stored = StoredCancels(session, clock=lambda: now[0])
    assert await stored.cancelled([(owner, batch_id)]) == set()
    await store.cancel(batch_id, AT)
    now[0] = 5.0
    assert await stored.cancelled([(owner, batch_id)]) == set(), "read again too soon"
    now[0] = 11.0
    assert await stored.cancelled([(owner, batch_id)]) == {(owner, batch_id)}
