"""The request ledger's round trips to a real Redis: calls made together share one
pipeline and each gets its own answer; an answer lost and the call sent again is taken
once; scripts Redis lost (a restart) are loaded again (workers/ledger.py,
workers/script_batch.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from infra.process import free_port
from tandoor.clients import redis_client
from tandoor.policies.redis_keys import lease_key, reply_key
from tandoor.settings import Settings
from tests.integration.test_ledger import ledger, request
from workers.ledger import Arrival, Busy, Finished, Recorded

pytestmark = pytest.mark.integration


async def test_records_made_together_share_a_round_trip_and_each_gets_its_own_answer(
    redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine step hands every running request a token at once: their records go in
    one pipeline, and a lost lease or a gap answers only the request it belongs to."""
    worker, rival = ledger(redis, "w1"), ledger(redis, "w2")
    rids = [request() for _ in range(32)]
    for rid in rids:
        assert isinstance(await worker.arrive(rid), Arrival)
    taken_over, gapped = rids[7], rids[19]
    await redis.delete(lease_key(taken_over))  # as if w1 stalled past its lease
    assert isinstance(await rival.arrive(taken_over), Arrival)
    pipelines = 0
    real_pipeline = redis.pipeline

    def counted(*args: object, **kwargs: object) -> object:
        nonlocal pipelines
        pipelines += 1
        return real_pipeline(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(redis, "pipeline", counted)
    seq = {rid: 2 if rid == gapped else 0 for rid in rids}
    outcomes = await asyncio.gather(
        *(worker.record(rid, 1, Recorded(1, seq[rid], f"w{i}", 1)) for i, rid in enumerate(rids))
    )
    assert pipelines == 1
    expected = {taken_over: "lost", gapped: "gap"}
    assert outcomes == [expected.get(rid, "ok") for rid in rids]
    stored = [await redis.lrange(reply_key(rid), 0, -1) for rid in rids]
    assert stored == [
        [] if rid in expected else [Recorded(1, 0, f"w{i}", 1).encode()]
        for i, rid in enumerate(rids)
    ]


async def test_records_made_together_while_redis_is_unreachable_each_say_so(
    settings: Settings,
) -> None:
    down = redis_client(settings.model_copy(update={"redis_port": free_port()}))
    worker = ledger(down, "w1")
    try:
        outcomes = await asyncio.gather(
            *(worker.record(request(), 1, Recorded(1, 0, "x", 1)) for _ in range(8))
        )
    finally:
        await down.aclose()
    assert outcomes == ["down"] * 8


class PipelineSentTwice(Pipeline):
    async def _execute_pipeline(self, *args: Any) -> Any:
        await super()._execute_pipeline(*args)
        return await super()._execute_pipeline(*args)


class AnswerLostOnce(aioredis.Redis):
    """Each script (alone, or in a pipeline) runs twice and the first answer is lost:
    what redis-py's retry on a dropped connection does when Redis ran the command before
    the connection dropped."""

    async def evalsha(self, *args: Any) -> Any:
        await super().evalsha(*args)
        return await super().evalsha(*args)

    def pipeline(self, transaction: bool = True, shard_hint: str | None = None) -> Pipeline:
        pool, callbacks = self.connection_pool, self.response_callbacks
        return PipelineSentTwice(pool, callbacks, transaction, shard_hint)


async def test_an_arrival_or_a_record_sent_again_after_its_answer_was_lost_is_taken_once(
    redis: aioredis.Redis,
) -> None:
    """The arrival sent again found the lease it had just taken and answered busy: the
    worker waited a whole lease for itself, then ran the reply as attempt 2. A record
    sent again found the transcript one entry longer and answered "gap": the reply was
    recorded no further, and a crash then restarted it rather than continue it."""
    retrying = AnswerLostOnce(connection_pool=redis.connection_pool)
    worker, rid = ledger(retrying, "w1"), request()
    taken = await worker.arrive(rid)
    assert isinstance(taken, Arrival) and taken.attempt == 1 and taken.leased
    assert await worker.record(rid, 1, Recorded(1, 0, "Once", 1)) == "ok"
    assert await worker.record(rid, 1, Recorded(1, 1, " upon", 1)) == "ok"
    assert await redis.lrange(reply_key(rid), 0, -1) == [
        Recorded(1, 0, "Once", 1).encode(),
        Recorded(1, 1, " upon", 1).encode(),
    ]
    assert isinstance(await ledger(redis, "w2").arrive(rid), Busy), "still leased to w1"
    assert isinstance(await worker.arrive(rid), Busy), "a second arrival is still refused"


async def test_a_recorded_final_is_delivered_by_one_waiter_at_a_time(
    redis: aioredis.Redis,
) -> None:
    """Its worker died between recording the final and publishing it. Two workers held
    copies of the prompt (its partition moved twice), each waiting out the dead lease:
    waking together, both were handed the final, and both published it (a second batch
    output line, a second usage record)."""
    owner, rid = ledger(redis, "w1"), request()
    assert isinstance(await owner.arrive(rid), Arrival)
    assert await owner.finish(rid, 1, b"the final") == "ok"
    await redis.delete(lease_key(rid))  # w1 died: its lease lapsed
    first, second = ledger(redis, "w2"), ledger(redis, "w3")
    assert await first.arrive(rid) == Finished(b"the final")
    assert isinstance(await second.arrive(rid), Busy), "w2 is delivering it"
    await first.delivered(rid)
    assert await second.arrive(rid) == Finished(None), "delivered: nothing to publish again"


async def test_a_delivering_arrival_sent_again_after_its_answer_was_lost_delivers(
    redis: aioredis.Redis,
) -> None:
    """Sent again, it found the lease it had just taken to deliver the final and waited
    a whole lease for itself."""
    owner, rid = ledger(redis, "w1"), request()
    assert isinstance(await owner.arrive(rid), Arrival)
    assert await owner.finish(rid, 1, b"the final") == "ok"
    await redis.delete(lease_key(rid))  # w1 died: its lease lapsed
    retrying = AnswerLostOnce(connection_pool=redis.connection_pool)
    assert await ledger(retrying, "w2").arrive(rid) == Finished(b"the final")


async def test_records_ask_redis_nothing_first_and_load_scripts_it_lost(
    redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records name their script by its digest alone: a pipeline that checked its scripts
    first (SCRIPT EXISTS) made two round trips of every event. Redis without the script
    (a restart) answered each record NOSCRIPT, which is no "Redis down", and the worker
    stopped; the lease renewal, which checks, met the same between check and calls."""
    worker, rids = ledger(redis, "w1"), [request() for _ in range(3)]
    for rid in rids:
        assert isinstance(await worker.arrive(rid), Arrival)
    checked, looks = Pipeline.load_scripts, 0

    async def then_lost(pipe: Pipeline) -> None:
        nonlocal looks
        await checked(pipe)  # type: ignore[no-untyped-call]
        looks += 1
        if looks == 1:  # the renewal's first
            await redis.script_flush()  # as a restart leaves them

    monkeypatch.setattr(Pipeline, "load_scripts", then_lost)
    for seq in range(2):  # the first with the scripts gone, the second with them loaded
        await redis.script_flush()
        outcomes = await asyncio.gather(
            *(worker.record(rid, 1, Recorded(1, seq, "x", 1)) for rid in rids)
        )
        assert outcomes == ["ok"] * 3 and looks == 0
    assert [await redis.llen(reply_key(rid)) for rid in rids] == [2, 2, 2]
    assert await worker.renew({rid: 1 for rid in rids}) == set()  # not renewed this time
    assert await worker.renew({rid: 1 for rid in rids}) == set() and looks == 2
