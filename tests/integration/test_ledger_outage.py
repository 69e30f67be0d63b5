"""A reply that ends while Redis is out of this worker's reach goes out unrecorded
(paid tiers are served through an outage); once it is out and Redis answers, the worker
marks it done, so that its prompt, fetched again later (a rebalance before its offset
was committed), is skipped instead of answered a second time from a transcript that
stopped at the outage (workers/late_done.py)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.exceptions import ConnectionError as RedisConnectionError

from tandoor.policies.redis_keys import done_key, final_key, lease_key
from tests.integration.test_ledger import ledger, request
from tests.unit.test_transcript_records import prompt
from workers import late_done, recording
from workers.attempt import Attempt, LeaseLost, Tracked
from workers.ledger import UNLEASED, Arrival, Busy, Finished, Recorded, RequestLedger

pytestmark = pytest.mark.integration


class OutOfReach(aioredis.Redis):
    """The test Redis, unreachable for this client alone while `away` is set."""

    away = False
    sent = 0  # pipelines

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        if self.away:
            raise RedisConnectionError("Redis out of reach (test)")
        return await super().execute_command(*args, **options)  # type: ignore[no-untyped-call]

    def pipeline(self, transaction: bool = True, shard_hint: str | None = None) -> Pipeline:
        return _PipelineOutOfReach(self, transaction, shard_hint)


class _PipelineOutOfReach(Pipeline):
    def __init__(self, client: OutOfReach, transaction: bool, shard_hint: str | None) -> None:
        super().__init__(client.connection_pool, client.response_callbacks, transaction, shard_hint)
        self.owner = client

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        self.owner.sent += 1
        if self.owner.away:
            raise RedisConnectionError("Redis out of reach (test)")
        return await super().execute(raise_on_error)


def out_of_reach(client: aioredis.Redis) -> OutOfReach:
    return OutOfReach(connection_pool=client.connection_pool)


async def ended_during_an_outage(
    redis: aioredis.Redis, count: int
) -> tuple[RequestLedger, RequestLedger, list[str]]:
    """`count` replies a worker finished while Redis was away, now back: its ledger,
    another worker's, and their request ids."""
    cut_off = out_of_reach(redis)
    worker, next_worker = ledger(cut_off, "w1"), ledger(redis, "w2")
    rids = [request() for _ in range(count)]
    cut_off.away = True
    for rid in rids:
        await worker.delivered_unrecorded(rid, 1)
    cut_off.away = False
    return worker, next_worker, rids


async def test_a_leased_reply_finished_during_an_outage_is_skipped_when_fetched_again(
    redis: aioredis.Redis,
) -> None:
    """Without the done mark, the prompt fetched again found the lease lapsed and the
    transcript at "Once": a second attempt went on from there and sent a second,
    different final, which replaced the stored reply the user had read."""
    cut_off = out_of_reach(redis)
    worker, next_worker, rid = ledger(cut_off, "w1"), ledger(redis, "w2"), request()
    assert isinstance(await worker.arrive(rid), Arrival)
    assert await worker.record(rid, 1, Recorded(1, 0, "Once", 1)) == "ok"
    cut_off.away = True
    assert await worker.record(rid, 1, Recorded(1, 1, " upon", 1)) == "down"
    assert await worker.finish(rid, 1, b"Once upon a time") == "down"
    await worker.delivered_unrecorded(rid, 1)  # its final and usage went out
    assert not await worker.late_done.record(), "Redis still away: kept"
    await redis.delete(lease_key(rid))  # the lease lapsed during the outage
    cut_off.away = False
    assert await worker.late_done.record()  # the next lease round: Redis answers
    assert await next_worker.arrive(rid) == Finished(None)
    assert await redis.get(lease_key(rid)) is None, "the lease it took back is given back"
    assert worker.late_done.owed == 0


async def test_an_end_out_once_redis_is_back_is_marked_done_with_its_lease_given_back(
    redis: aioredis.Redis,
) -> None:
    """Given back first, the lease let a prompt fetched again in before the next lease
    round marked the request done: a second attempt, from the cut-short transcript."""
    cut_off = out_of_reach(redis)
    worker, next_worker, rid = ledger(cut_off, "w1"), ledger(redis, "w2"), request()
    assert isinstance(await worker.arrive(rid), Arrival)
    cut_off.away = True
    assert await worker.finish(rid, 1, b"the final") == "down"
    cut_off.away = False
    assert isinstance(await next_worker.arrive(rid), Busy), "still leased while it sends"
    await worker.delivered_unrecorded(rid, 1)
    assert await next_worker.arrive(rid) == Finished(None)
    assert await redis.get(lease_key(rid)) is None and worker.late_done.owed == 0


async def test_a_finish_redis_ran_whose_answer_was_lost_leaves_no_final_to_send_again(
    redis: aioredis.Redis,
) -> None:
    """FINISH ran and its answer timed out, so the worker took Redis for away: the late
    mark left the recorded final behind, and the worker the prompt reached next
    published it, and its usage record, a second time."""
    worker, next_worker, rid = ledger(redis, "w1"), ledger(redis, "w2"), request()
    assert isinstance(await worker.arrive(rid), Arrival)
    assert await worker.finish(rid, 1, b"the final") == "ok"  # its answer lost
    await worker.delivered_unrecorded(rid, 1)
    assert await next_worker.arrive(rid) == Finished(None)


def held_long(client: aioredis.Redis, name: str) -> RequestLedger:
    """A worker's ledger whose leases outlast the test: each lapse is made by hand."""
    return RequestLedger(client, name, 60.0)


def finished_attempt(rid: str, final: bytes) -> Attempt:
    """An attempt whose FINISH had no answer: its final, unrecorded as far as it knows."""
    attempt = Attempt(prompt().model_copy(update={"request_id": rid}), Tracked(rid), 1, 1)
    attempt.tracked.leased, attempt.tracked.unrecorded_final = True, final
    return attempt


async def test_a_finish_whose_answer_was_lost_goes_out_after_redis_was_away_past_the_lease(
    redis: aioredis.Redis,
) -> None:
    """FINISH ran, its answer lost, and Redis stayed away past the lease: asked then
    whether the lease was still its own, Redis said the request was done, which the
    worker took for another worker's. The final never went out and the prompt was
    committed: the user's stream ended at its timeout, with no usage record."""
    worker, rid = held_long(redis, "w1"), request()
    assert isinstance(await worker.arrive(rid), Arrival)
    assert await worker.finish(rid, 1, b"the final") == "ok"  # its answer lost
    attempt = finished_attempt(rid, b"the final")
    await redis.delete(lease_key(rid))  # lapsed during the outage
    worker.leases.forget(rid)  # and here
    await recording.fenced(worker, attempt)  # Redis back
    assert not attempt.tracked.lost and attempt.tracked.unrecorded_final is None, "recorded"
    assert await redis.get(lease_key(rid)) == b"w1", "its own to deliver"


async def test_a_finish_sent_again_is_not_the_callers_once_another_worker_delivers_it(
    redis: aioredis.Redis,
) -> None:
    """The recorded final is found by the worker the prompt reached next: it delivers
    it, and the worker whose FINISH answer was lost publishes nothing."""
    worker, next_worker, rid = held_long(redis, "w1"), held_long(redis, "w2"), request()
    assert isinstance(await worker.arrive(rid), Arrival)
    assert await worker.finish(rid, 1, b"the final") == "ok"  # its answer lost
    await redis.delete(lease_key(rid))
    assert await next_worker.arrive(rid) == Finished(b"the final")
    assert await worker.finish(rid, 1, b"the final") == "lost", "the other delivers it"
    await next_worker.delivered(rid)
    assert await worker.finish(rid, 1, b"the final") == "lost", "delivered"
    attempt = finished_attempt(rid, b"the final")
    worker.leases.forget(rid)
    with pytest.raises(LeaseLost):
        await recording.fenced(worker, attempt)


async def test_a_finish_sent_again_after_its_final_was_delivered_stores_nothing(
    redis: aioredis.Redis,
) -> None:
    """A FINISH sent again (a lease round's, its connection retried) landing between
    `delivered`'s two steps stored the final again: the worker the prompt reached next
    sent it, and its usage record, a second time."""
    worker, next_worker, rid = held_long(redis, "w1"), held_long(redis, "w2"), request()
    assert isinstance(await worker.arrive(rid), Arrival)
    assert await worker.finish(rid, 1, b"the final") == "ok"
    await redis.delete(final_key(rid))  # delivered's first step
    assert await worker.finish(rid, 1, b"the final") == "ok"
    await worker.release(rid)
    assert await next_worker.arrive(rid) == Finished(None)


async def test_a_finish_after_the_gateway_withdrew_the_prompt_keeps_its_final(
    redis: aioredis.Redis,
) -> None:
    """Taken before the gateway's withdrawal marked it done ("0"), the reply, told to
    stop, finished: found done, FINISH stored no final, and the worker the prompt
    reached next (the first stopped before its usage record was out) skipped it."""
    worker, next_worker, rid = held_long(redis, "w1"), held_long(redis, "w2"), request()
    assert isinstance(await worker.arrive(rid), Arrival)
    await redis.set(done_key(rid), 0)  # the gateway's withdrawal
    assert await worker.finish(rid, 1, b"the final") == "ok"
    await worker.release(rid)
    assert await next_worker.arrive(rid) == Finished(b"the final")


async def test_a_finish_is_not_taken_for_another_attempts_sent_again(
    redis: aioredis.Redis,
) -> None:
    worker, next_worker, rid = held_long(redis, "w1"), held_long(redis, "w2"), request()
    assert isinstance(await worker.arrive(rid), Arrival)
    await redis.delete(lease_key(rid))
    assert isinstance(await next_worker.arrive(rid), Arrival)
    assert await next_worker.finish(rid, 2, b"the final") == "ok"
    await redis.delete(lease_key(rid))
    assert await worker.finish(rid, 1, b"the final") == "lost", "a later attempt's"
    assert await worker.finish(rid, 2, b"another final") == "lost", "another final"


async def test_a_finish_run_unanswered_past_the_lease_leaves_no_final_to_send_again(
    redis: aioredis.Redis,
) -> None:
    """As above, Redis away past the lease after it: the late mark, refused as "done
    already", left the recorded final for the next worker to publish a second time."""
    worker, next_worker, rid = held_long(redis, "w1"), held_long(redis, "w2"), request()
    assert isinstance(await worker.arrive(rid), Arrival)
    assert await worker.finish(rid, 1, b"the final") == "ok"  # its answer lost
    await redis.delete(lease_key(rid))  # lapsed during the outage
    await worker.delivered_unrecorded(rid, 1)
    assert await next_worker.arrive(rid) == Finished(None)
    assert worker.late_done.owed == 0


async def test_replies_ending_during_an_outage_do_not_each_wait_for_redis(
    redis: aioredis.Redis,
) -> None:
    """Each reply that ended sent its mark, one at a time, each waiting out the
    client's retries: the replies queued, their prompts uncommitted meanwhile."""
    cut_off = out_of_reach(redis)
    worker, next_worker = ledger(cut_off, "w1"), ledger(redis, "w2")
    rids = [request() for _ in range(5)]
    cut_off.away = True
    for rid in rids:
        await worker.delivered_unrecorded(rid, 1)
    assert cut_off.sent == 1, "the first found Redis away: the rest wait for a round"
    assert not await worker.late_done.record()
    cut_off.away = False
    assert await worker.late_done.record() and cut_off.sent == 3
    assert [await next_worker.arrive(rid) for rid in rids] == [Finished(None)] * 5


async def test_the_worker_that_owes_the_mark_skips_its_own_prompt_fetched_again(
    redis: aioredis.Redis,
) -> None:
    """Fetched again on this worker (a rebalance kept it the partition) while its mark
    waited: Redis away, it ran the prompt again unleased; back, a second attempt under
    its own name, which the late mark then cut off (same owner) mid-reply."""
    cut_off = out_of_reach(redis)
    worker, rid = ledger(cut_off, "w1"), request()
    assert isinstance(await worker.arrive(rid), Arrival)
    cut_off.away = True
    assert await worker.finish(rid, 1, b"the final") == "down"
    await worker.delivered_unrecorded(rid, 1)
    assert await worker.arrive(rid) == Finished(None), "Redis away: known here"
    await redis.delete(lease_key(rid))
    cut_off.away = False
    assert await worker.arrive(rid) == Finished(None), "Redis back, the mark not yet sent"
    # The same worker's next life (a restart): a later attempt under its name.
    restarted = ledger(redis, "w1")
    again = await restarted.arrive(rid)
    assert isinstance(again, Arrival) and again.attempt == 2
    assert await worker.late_done.record()
    assert await redis.get(lease_key(rid)) == b"w1", "attempt 2 goes on"
    assert not await redis.exists(done_key(rid))


async def test_a_reply_taken_and_finished_during_an_outage_is_skipped_when_fetched_again(
    redis: aioredis.Redis,
) -> None:
    cut_off = out_of_reach(redis)
    worker, next_worker, rid = ledger(cut_off, "w1"), ledger(redis, "w2"), request()
    cut_off.away = True
    assert await worker.arrive(rid) == UNLEASED
    await worker.delivered_unrecorded(rid, UNLEASED.attempt)
    cut_off.away = False
    assert await worker.late_done.record()
    assert await next_worker.arrive(rid) == Finished(None)


async def test_a_reply_another_worker_took_over_first_is_left_to_it(
    redis: aioredis.Redis,
) -> None:
    """Fetched again before this worker's lease round after the outage: the other
    worker runs it (the risk of an outage), and is not marked done under it."""
    cut_off = out_of_reach(redis)
    worker, next_worker, rid = ledger(cut_off, "w1"), ledger(redis, "w2"), request()
    assert isinstance(await worker.arrive(rid), Arrival)
    cut_off.away = True
    assert await worker.finish(rid, 1, b"the final") == "down"
    await worker.delivered_unrecorded(rid, 1)
    await redis.delete(lease_key(rid))
    taken = await next_worker.arrive(rid)
    assert isinstance(taken, Arrival) and taken.attempt == 2
    cut_off.away = False
    assert await worker.late_done.record()
    assert await redis.get(lease_key(rid)) == b"w2"
    assert not await redis.exists(done_key(rid)) and worker.late_done.owed == 0


async def test_owed_marks_are_each_sent_once_and_all_of_them_at_a_stop(
    redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The lease loop's round and the stop's ran together: both sent the same marks, and
    the second's answers (refused: already done) were taken for another worker's."""
    monkeypatch.setattr(late_done, "ROUND_SIZE", 2)
    worker, next_worker, rids = await ended_during_an_outage(redis, 5)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="workers.late_done"):
        await asyncio.gather(worker.late_done.record(), worker.late_done.record_all())
    assert [r.getMessage() for r in caplog.records] == []
    assert [await next_worker.arrive(rid) for rid in rids] == [Finished(None)] * 5


async def test_only_the_latest_ends_are_kept_for_a_long_outage(
    redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(late_done, "OWED_DONE_MAX", 2)
    worker, next_worker, rids = await ended_during_an_outage(redis, 3)
    assert await worker.late_done.record()
    first = await next_worker.arrive(rids[0])
    assert isinstance(first, Arrival), "the oldest was let go"
    assert [await next_worker.arrive(rid) for rid in rids[1:]] == [Finished(None)] * 2
