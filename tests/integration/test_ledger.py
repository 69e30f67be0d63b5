"""The request ledger against a real Redis: one lease holder at a time, a stalled worker
that lost its lease cannot publish, a transcript without gaps, and a final kept until
it is delivered (workers/ledger.py)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest
import redis.asyncio as aioredis

from infra.process import free_port
from tandoor.clients import redis_client
from tandoor.policies.redis_keys import (
    attempt_key,
    batch_cancel_key,
    done_key,
    final_key,
    lease_key,
    reply_key,
)
from tandoor.settings import Settings
from tests.unit.test_transcript_records import prompt
from tests.waiting import eventually, until
from workers.attempt import Attempt, LeaseLost, Tracked
from workers.ledger import UNKNOWN_TEXT, Arrival, Busy, Finished, Recorded, RequestLedger
from workers.metrics import WorkerMetrics
from workers.request import RequestRunner, RunnerConfig

pytestmark = pytest.mark.integration

LEASE_S = 1.0


@pytest.fixture
async def client(redis_url: str, settings: Settings) -> AsyncIterator[aioredis.Redis]:
    redis = redis_client(settings)
    yield redis
    await redis.aclose()


def ledger(client: aioredis.Redis, name: str) -> RequestLedger:
    return RequestLedger(client, name, LEASE_S)


def request() -> str:
    return f"r_{uuid.uuid4().hex}"


async def test_one_holder_at_a_time_and_the_next_takes_over_when_it_lapses(
    client: aioredis.Redis,
) -> None:
    first, second, rid = ledger(client, "w1"), ledger(client, "w2"), request()
    taken = await first.arrive(rid)
    assert isinstance(taken, Arrival) and taken.attempt == 1 and taken.leased
    busy = await second.arrive(rid)
    assert isinstance(busy, Busy) and 0 < busy.wait_ms <= LEASE_S * 1000
    assert isinstance(await first.arrive(rid), Busy), "not even its holder runs it twice"
    assert await first.record(rid, 1, Recorded(1, 0, "Once", 1)) == "ok"
    await eventually(  # w1 stalls past its lease: Redis lets it lapse
        lambda: client.exists(lease_key(rid)), lambda held: not held, what="w1's lease lapsed"
    )
    again = await second.arrive(rid)
    assert isinstance(again, Arrival) and again.attempt == 2
    assert again.transcript == (Recorded(1, 0, "Once", 1),)
    assert await first.record(rid, 1, Recorded(1, 1, " upon", 1)) == "lost"
    assert await first.renew({rid: 1}) == {rid}
    assert await first.finish(rid, 1, b"final of w1") == "lost", "a lost lease publishes no final"
    assert await second.record(rid, 2, Recorded(1, 1, " upon", 1)) == "ok"


async def test_a_lease_that_lapsed_with_no_one_taking_over_is_its_holders_again(
    client: aioredis.Redis,
) -> None:
    """Redis lost the lease (restarted empty, or out of reach past it) and no other
    worker took the request: its holder goes on, the only one that will run it (it
    stopped and committed the prompt, and the reply was lost). Once another worker has
    taken the request, or finished it, the lapsed holder stays stopped."""
    worker, rid = ledger(client, "w1"), request()
    assert isinstance(await worker.arrive(rid), Arrival)
    assert await worker.record(rid, 1, Recorded(1, 0, "Once", 1)) == "ok"
    await client.delete(lease_key(rid))  # the lease lapsed, nobody arrived
    assert await worker.renew({rid: 1}) == set()
    assert await client.get(lease_key(rid)) == b"w1"
    await client.delete(lease_key(rid), attempt_key(rid), reply_key(rid))  # Redis restarted
    assert await worker.record(rid, 1, Recorded(1, 1, " upon", 1)) == "gap"  # not "lost"
    assert await worker.finish(rid, 1, b"the final") == "ok"

    rival, taken, done = ledger(client, "w2"), request(), request()
    for rid in (taken, done):
        assert isinstance(await worker.arrive(rid), Arrival)
        await client.delete(lease_key(rid))  # w1 stalled past its lease
        assert isinstance(await rival.arrive(rid), Arrival)
    await rival.release(taken)  # and died: the next arrival runs it, not w1
    assert await rival.finish(done, 2, b"final of w2") == "ok"
    await rival.delivered(done)
    for rid in (taken, done):
        assert await worker.record(rid, 1, Recorded(1, 0, "x", 1)) == "lost"
        assert await worker.renew({rid: 1}) == {rid}
        assert await worker.finish(rid, 1, b"final of w1") == "lost"
        assert await client.get(lease_key(rid)) is None


async def test_a_lease_given_back_is_not_renewed_back(client: aioredis.Redis) -> None:
    """The renew loop's list still had a request given back at a hand-over: its renewal
    took the lapsed lease back (not done, no later attempt), and the next worker waited
    the lease out."""
    worker, rid = ledger(client, "w1"), request()
    assert isinstance(await worker.arrive(rid), Arrival)
    await worker.release(rid)  # handed back at SIGTERM
    assert await worker.renew({rid: 1}) == set()
    assert await client.get(lease_key(rid)) is None
    taken = await ledger(client, "w2").arrive(rid)
    assert isinstance(taken, Arrival) and taken.attempt == 2


async def test_a_batch_cancel_cancels_a_line_arriving_after_it(client: aioredis.Redis) -> None:
    """A line forwarded before its batch was cancelled is not run when it arrives."""
    batch_cancel = batch_cancel_key("u", f"batch_{uuid.uuid4().hex}")
    before, after = request(), request()
    taken = await ledger(client, "w1").arrive(before, batch_cancel)
    assert isinstance(taken, Arrival) and not taken.cancelled
    await client.set(batch_cancel, 1, ex=60)
    late = await ledger(client, "w1").arrive(after, batch_cancel)
    assert isinstance(late, Arrival) and late.cancelled
    alone = await ledger(client, "w1").arrive(request())  # no batch: its own cancel only
    assert isinstance(alone, Arrival) and not alone.cancelled


async def test_a_gap_in_the_transcript_is_refused(client: aioredis.Redis) -> None:
    worker, rid = ledger(client, "w1"), request()
    assert isinstance(await worker.arrive(rid), Arrival)
    assert await worker.record(rid, 1, Recorded(1, 0, "a", 1)) == "ok"
    assert await worker.record(rid, 1, Recorded(1, 2, "c", 1)) == "gap"


async def test_a_final_is_kept_until_delivered_and_then_the_request_is_skipped(
    client: aioredis.Redis,
) -> None:
    dying, next_worker, rid = ledger(client, "w1"), ledger(client, "w2"), request()
    assert isinstance(await dying.arrive(rid), Arrival)
    assert await dying.finish(rid, 1, b"the final") == "ok"
    await dying.release(rid)  # it died after recording the final, before delivering it
    assert await next_worker.arrive(rid) == Finished(b"the final")
    await next_worker.delivered(rid)
    assert await next_worker.arrive(rid) == Finished(None)


async def test_an_undelivered_final_lives_as_long_as_the_done_mark(client: aioredis.Redis) -> None:
    """A prompt redelivered after a long outage (its worker died between recording the
    final and delivering it) finds the final while it finds the request done: a done
    request without its final is skipped, and its reply would never end."""
    dying, rid = ledger(client, "w1"), request()
    assert isinstance(await dying.arrive(rid), Arrival)
    assert await dying.finish(rid, 1, b"the final") == "ok"
    done_ttl, final_ttl = await client.ttl(done_key(rid)), await client.ttl(final_key(rid))
    assert done_ttl > 0 and final_ttl >= done_ttl


async def test_a_worker_past_its_lease_leaves_the_next_ones_transcript_alone(
    client: aioredis.Redis,
) -> None:
    """Its record failed (Redis stalled past its lease) and another worker took over,
    continuing the reply: once Redis answered, the first dropped the transcript the
    second was writing, whose next record then failed as a gap."""
    stalled, next_worker, rid = ledger(client, "w1"), ledger(client, "w2"), request()
    assert isinstance(await stalled.arrive(rid), Arrival)
    assert await stalled.record(rid, 1, Recorded(1, 0, "Once", 1)) == "ok"
    lease = lambda: client.exists(lease_key(rid))  # noqa: E731
    await eventually(lease, lambda held: not held, what="the stalled worker's lease lapsed")
    assert isinstance(await next_worker.arrive(rid), Arrival)
    assert await next_worker.record(rid, 2, Recorded(1, 1, " upon", 1)) == "ok"
    assert await stalled.forget_transcript(rid, 1, begun=True) == "lost"
    assert await stalled.holds(rid, 1) == "lost"
    assert await next_worker.holds(rid, 2) == "ok"
    assert await next_worker.record(rid, 2, Recorded(1, 2, " a", 1)) == "ok"


async def test_a_request_taken_while_redis_stalled_is_leased_once_it_answers(
    client: aioredis.Redis, settings: Settings
) -> None:
    """Its arrival timed out (UNLEASED): once Redis answers, it leases the request, so a
    redelivery (a rebalance) waits for it rather than running it again, and its end is
    recorded; unless another worker took it or finished it meanwhile."""
    stalled, redelivered, rid = ledger(client, "w1"), ledger(client, "w2"), request()
    assert await stalled.lease_late(rid) == "ok"
    assert isinstance(await redelivered.arrive(rid), Busy)
    assert await stalled.finish(rid, 1, b"the final") == "ok"
    await stalled.delivered(rid)
    assert await redelivered.arrive(rid) == Finished(None), "done: not run again"

    ran_stalled = ledger(client, "w1")  # its arrival did run, then its answer was lost
    rid = request()
    assert isinstance(await ran_stalled.arrive(rid), Arrival)
    assert await ran_stalled.lease_late(rid) == "ok"

    rid, done = request(), request()
    for taken in (rid, done):
        assert isinstance(await redelivered.arrive(taken), Arrival)
    assert await redelivered.finish(done, 1, b"final of w2") == "ok"
    await redelivered.delivered(done)
    for taken in (rid, done):
        assert await stalled.lease_late(taken) == "lost"
    assert await client.get(lease_key(rid)) == b"w2"
    down = redis_client(settings.model_copy(update={"redis_port": free_port()}))
    assert await ledger(down, "w1").lease_late(request()) == "down", "while Redis is away"
    await down.aclose()


async def test_a_transcript_dropped_mid_reply_still_says_the_reply_began(
    client: aioredis.Redis,
) -> None:
    worker, rid = ledger(client, "w1"), request()
    assert isinstance(await worker.arrive(rid), Arrival)
    assert await worker.record(rid, 1, Recorded(1, 0, "Once", 1)) == "ok"
    assert await worker.forget_transcript(rid, 1, begun=True) == "ok"
    await worker.release(rid)
    taken = await ledger(client, "w2").arrive(rid)
    assert isinstance(taken, Arrival) and taken.transcript == (UNKNOWN_TEXT,)


async def test_a_lease_given_back_is_taken_at_once(client: aioredis.Redis) -> None:
    leaving, staying, rid = ledger(client, "w1"), ledger(client, "w2"), request()
    assert isinstance(await leaving.arrive(rid), Arrival)
    await leaving.release(rid)  # handed back at SIGTERM
    taken = await staying.arrive(rid)
    assert isinstance(taken, Arrival) and taken.attempt == 2


async def test_a_final_its_live_worker_is_delivering_is_not_delivered_again(
    client: aioredis.Redis,
) -> None:
    """Between recording its final and delivering it, the owner holds its lease: a
    worker waiting on the request (a moved partition) took the final as one whose
    worker died and published it a second time (a second batch output line)."""
    owner, waiting, rid = ledger(client, "w1"), ledger(client, "w2"), request()
    assert isinstance(await owner.arrive(rid), Arrival)
    assert await owner.finish(rid, 1, b"the final") == "ok"
    assert isinstance(await waiting.arrive(rid), Busy)
    await owner.delivered(rid)
    assert await waiting.arrive(rid) == Finished(None)


async def test_a_restart_handed_back_before_it_records_still_says_the_reply_began(
    client: aioredis.Redis,
) -> None:
    """Attempt 2 restarts a reply whose text is not all known, and is handed back before
    its first event: attempt 3 found an empty transcript and, past the deadline,
    answered "expired" to a reader who had part of the reply."""
    rid = request()
    first, second, third = (ledger(client, f"w{i}") for i in (1, 2, 3))
    assert isinstance(await first.arrive(rid), Arrival)
    assert await first.record(rid, 1, Recorded(1, 0, "Once", 1)) == "ok"
    assert await first.forget_transcript(rid, 1, begun=True) == "ok"  # a record failed after
    await first.release(rid)
    arrival = await second.arrive(rid)
    assert isinstance(arrival, Arrival) and arrival.transcript == (UNKNOWN_TEXT,)
    runner = RequestRunner(RunnerConfig("m", 0.1, 16), None, None, second, None, None)  # type: ignore[arg-type]
    restart = await runner._attempt(
        prompt().model_copy(update={"request_id": rid}), Tracked(rid), arrival
    )
    assert restart.begun and not restart.carried
    await second.release(rid)  # handed back (SIGTERM) before its first event
    arrival = await third.arrive(rid)
    assert isinstance(arrival, Arrival) and arrival.transcript == (UNKNOWN_TEXT,)
    # The restart's first event takes the marker's place: the next can continue it.
    assert await third.record(rid, 3, Recorded(3, 0, "Hello", 1)) == "ok"
    await third.release(rid)
    arrival = await ledger(client, "w4").arrive(rid)
    assert isinstance(arrival, Arrival) and arrival.transcript == (Recorded(3, 0, "Hello", 1),)


class Published:
    """Kafka, as the runner sends token events to it: what went out."""

    def __init__(self) -> None:
        self.deltas: list[str] = []

    async def token(self, event: Any, key: str, partition: int | None) -> asyncio.Future[None]:
        self.deltas.append(event.delta)
        sent: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        sent.set_result(None)
        return sent


async def test_a_worker_cut_off_from_redis_past_its_lease_publishes_nothing_more(
    client: aioredis.Redis, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis out of reach from one worker only (its host's network, its breaker): its
    records failed, so it published on without a lease check, while a worker that
    reached Redis took the request over and continued it under the same sequence
    numbers with other text."""
    rid, kafka = request(), Published()
    reaching = ledger(client, "w1")
    assert isinstance(await reaching.arrive(rid), Arrival)
    down = redis_client(settings.model_copy(update={"redis_port": free_port()}))
    cut_off = ledger(down, "w1")
    cut_off.leases = reaching.leases  # what Redis last said to w1
    asked: list[str] = []

    async def holds(request_id: str, attempt: int) -> str:
        asked.append(request_id)
        return await RequestLedger.holds(cut_off, request_id, attempt)

    monkeypatch.setattr(cut_off, "holds", holds)
    config, metrics = RunnerConfig("m", 0.05, 16), WorkerMetrics("m")
    unused = cast(Any, None)
    runner = RequestRunner(config, unused, cast(Any, kafka), cut_off, unused, metrics)
    line = prompt().model_copy(update={"request_id": rid})
    attempt = Attempt(line, Tracked(rid, leased=True), 1, 1, recording=True)
    await runner._send_tokens(attempt, "Once", 1)  # within its lease: out, unrecorded
    await eventually(  # w1 stays cut off past its lease: Redis lets it lapse
        lambda: client.exists(lease_key(rid)), lambda held: not held, what="w1's lease lapsed"
    )
    taken = await ledger(client, "w2").arrive(rid)
    assert isinstance(taken, Arrival) and taken.attempt == 2
    sending = asyncio.create_task(runner._send_tokens(attempt, " upon", 1))
    try:
        await until(lambda: asked or sending.done(), what="w1 asking Redis whose the lease is")
        assert kafka.deltas == ["Once"], "published past its lease"
        cut_off._renew = reaching._renew  # Redis in reach again: the lease is w2's
        with pytest.raises(LeaseLost):
            await asyncio.wait_for(sending, 30)
        assert kafka.deltas == ["Once"] and attempt.tracked.lost
    finally:
        sending.cancel()
        await down.aclose()
