"""Batches the Kafka way: raw OpenAI batch-input records on `batch.requests`, the admission
role, the package's real worker and the persistence consumer, results read back from
`batch.results`. A bad line, a bad key and a repeated custom_id are answered with errors
and never reach the model's topic; the band's backlog stays shallow; kill -9 of the
admission role mid-batch runs no line twice and loses none, nor do admission members
joining and leaving mid-batch; a tenant's flood does not hold back another tenant's
small batch."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer

from infra.roles import AdmissionProcess, PersistProcess, WorkerProcess, running
from producers.batch_topic import ResultsReader, chat_line, send_lines
from producers.model_load import backlog_clients, partition_backlog
from schemas import topics
from schemas.batch import AUTHORIZATION_HEADER, DEADLINE_HEADER
from schemas.events import now_ms
from schemas.topics import BandLayout
from tandoor.clients import cassandra_session
from tandoor.policies.redis_keys import batch_cancel_key
from tandoor.settings import Settings
from tests.integration.batch_lines import (
    BACKLOG_PER_WORKER,
    BLOCKED,
    all_results,
    answered,
    batch_key,
    batch_on_another_partition,
    question,
    slow_tenant,
)
from tests.queued import queued
from tests.waiting import eventually

pytestmark = pytest.mark.integration
LINES = 200
FLOOD, SMALL = 2000, 20
FAIR_BACKLOG = 4  # the fairness run's: the flood's lines in the band when it starts
CRASH_LINES = 100
HELD_LINES = 20


async def test_a_200_line_batch_on_the_topic_is_answered_once_per_line(
    settings: Settings,
    worker: WorkerProcess,
    producer: AIOKafkaProducer,
    roles_env: dict[str, str],
    results: ResultsReader,
    tmp_path: Path,
) -> None:
    key, owner = await batch_key(settings, "kafka-batcher")
    batch_id = f"nightly-{uuid.uuid4().hex[:6]}"
    good = [question(worker.model, i) for i in range(LINES)]
    bad = [
        b'{"custom_id": "broken", "method": "POST"',  # cut off: not JSON
        orjson.dumps(
            chat_line(
                "no-model", {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}
            )
        ),
        orjson.dumps(
            chat_line(
                "blocked",
                {
                    "model": worker.model,
                    "messages": [{"role": "user", "content": f"say {BLOCKED}"}],
                },
            )
        ),
        question(worker.model, 0),  # line-0 again
        orjson.dumps(  # line-1 again, refused for itself: still a repeat, with its own id
            chat_line(
                "line-1",
                {
                    "model": worker.model,
                    "messages": [{"role": "user", "content": f"say {BLOCKED}"}],
                },
            )
        ),
    ]
    before = await queued(settings, worker.model)
    await send_lines(producer, key, batch_id, [*good, *bad])
    await send_lines(producer, "tdr_not-a-key", batch_id, [question(worker.model, 999)])

    band_peak = 0
    async with running(
        [AdmissionProcess(tmp_path, roles_env), PersistProcess(tmp_path, roles_env)]
    ):
        async with watch_batch_band(settings, worker.model) as peak:
            got = list(await all_results(results, batch_id, LINES + len(bad) + 1))
            band_peak = max(peak)
            # line-0 yet again, once its answer is stored: refused, the answer kept.
            await send_lines(producer, key, batch_id, [question(worker.model, 0)])
            late = (await all_results(results, batch_id, len(got) + 1))[len(got) :]
            # An id over 256 characters: answered under the whole id (it was cut).
            await send_lines(producer, key, batch_id * 40, [question(worker.model, 0)])
            (too_long,) = await all_results(results, batch_id * 40, 1)
    assert [r["response"]["status_code"] for r in late] == [400], late
    assert too_long["response"]["status_code"] == 400, too_long
    assert "batch id" in too_long["response"]["body"]["error"]["message"]
    with cassandra_session(settings, settings.keyspace) as session:
        kept = session.execute(
            "SELECT custom_id, status_code FROM batch_outputs WHERE user_id = %s "
            "AND batch_id = %s AND custom_id IN ('line-0', 'line-1')",
            (owner, batch_id),
        )
        assert {row.custom_id: row.status_code for row in kept} == {
            "line-0": 200,
            "line-1": 200,
        }, "a repeat replaced the answer"

    by_id = Counter(r["custom_id"] for r in got)
    assert by_id[None] == 1, by_id  # the broken line
    assert by_id["line-0"] == by_id["line-1"] == 2, by_id  # each with its repeat
    assert all(by_id[f"line-{i}"] == 1 for i in range(2, LINES)), "a line answered twice"
    errors = {r["custom_id"]: r["response"] for r in got if r["response"]["status_code"] != 200}
    assert errors[None]["status_code"] == 400
    assert "not JSON" in errors[None]["body"]["error"]["message"]
    assert errors["no-model"]["status_code"] == 404
    assert errors["blocked"]["status_code"] == 400
    assert errors["blocked"]["body"]["error"]["param"] == "body.messages.0.content"
    assert errors["line-999"]["status_code"] == 401
    for repeated in ("line-0", "line-1"):
        repeats = [r for r in got if r["custom_id"] == repeated]
        assert sorted(r["response"]["status_code"] for r in repeats) == [200, 400]
        # Two answers, two ids: a consumer keeping one per id kept the refusal, not the reply.
        assert len({r["id"] for r in repeats}) == 2, repeats
    texts = {r["custom_id"]: answered(r) for r in got if r["response"]["status_code"] == 200}
    assert len(texts) == LINES and all(texts.values())
    # Each answer is to its own line: it repeats the line's number or gives the sum.
    right = sum(
        str(i) in texts[f"line-{i}"] or str(2 * i) in texts[f"line-{i}"] for i in range(LINES)
    )
    assert right > LINES // 2, f"only {right} answers match their line"
    # Only the good lines reached the model, and the band never held the whole batch.
    assert await queued(settings, worker.model) - before == LINES
    assert band_peak <= 3 * BACKLOG_PER_WORKER, f"the batch band held {band_peak} prompts"


async def test_lines_past_their_batch_deadline_are_answered_expired_and_never_run(
    settings: Settings,
    worker: WorkerProcess,
    producer: AIOKafkaProducer,
    roles_env: dict[str, str],
    results: ResultsReader,
    tmp_path: Path,
) -> None:
    key, owner = await batch_key(settings, "late-batcher")
    late, on_time, garbled = (f"{name}-{uuid.uuid4().hex[:6]}" for name in ("late", "ok", "bad"))
    before = await queued(settings, worker.model)
    lines = [question(worker.model, i) for i in range(5)]
    await send_lines(producer, key, late, lines, deadline_ms=now_ms() - 1000)
    await send_lines(producer, key, on_time, lines[:1], deadline_ms=now_ms() + 3_600_000)
    headers = [(AUTHORIZATION_HEADER, f"Bearer {key}".encode()), (DEADLINE_HEADER, b"tomorrow")]
    await producer.send_and_wait(
        topics.BATCH_REQUESTS, lines[0], key=garbled.encode(), headers=headers
    )
    async with running(
        [AdmissionProcess(tmp_path, roles_env), PersistProcess(tmp_path, roles_env)]
    ):
        expired = await all_results(results, late, len(lines))
        ran = await all_results(results, on_time, 1)
        refused = await all_results(results, garbled, 1)
    assert sorted(r["custom_id"] for r in expired) == [f"line-{i}" for i in range(5)]
    assert all(r["response"] is None for r in expired), expired
    assert {r["error"]["code"] for r in expired} == {"batch_expired"}
    assert answered(ran[0])  # a deadline still ahead: run as usual
    assert refused[0]["response"]["status_code"] == 400
    assert "batch-deadline-ms" in refused[0]["response"]["body"]["error"]["message"]
    assert await queued(settings, worker.model) - before == 1  # only the one on time
    with cassandra_session(settings, settings.keyspace) as session:
        kept = session.execute(
            "SELECT custom_id FROM batch_outputs WHERE user_id = %s AND batch_id = %s",
            (owner, late),
        )
        assert len(list(kept)) == len(lines)  # in the batch's error file


async def all_settled(
    settings: Settings, results: ResultsReader, model: str, batch_id: str
) -> None:
    """Every line answered, and nothing left to run: every prompt in the band is finished
    (committed), so a line run twice has its second final out, on its way through persist."""
    await all_results(results, batch_id, CRASH_LINES)
    await eventually(lambda: band_backlog(settings, model), lambda n: n == 0, what="band empty")
    await results.poll()


def assert_each_line_answered_once(results: ResultsReader, batch_id: str) -> None:
    got = results.copies(batch_id)  # every copy: a line answered twice fails
    by_id = Counter(r["custom_id"] for r in got)
    assert sorted(by_id) == sorted(f"line-{i}" for i in range(CRASH_LINES))
    assert set(by_id.values()) == {1}, [c for c, n in by_id.items() if n > 1]
    assert all(answered(r) for r in got)


async def test_kill_9_of_admission_mid_batch_runs_no_line_twice_and_loses_none(
    settings: Settings,
    worker: WorkerProcess,
    producer: AIOKafkaProducer,
    roles_env: dict[str, str],
    results: ResultsReader,
    tmp_path: Path,
) -> None:
    key, _ = await batch_key(settings, "crash-batcher")
    batch_id = f"crash-{uuid.uuid4().hex[:6]}"
    before = await queued(settings, worker.model)
    lines = [question(worker.model, i) for i in range(CRASH_LINES)]
    await send_lines(producer, key, batch_id, lines)

    first = AdmissionProcess(tmp_path, roles_env)
    async with running([PersistProcess(tmp_path, roles_env)]):
        async with running([first]):
            await all_results(results, batch_id, CRASH_LINES // 4)
            await asyncio.to_thread(first.kill)
        async with running([AdmissionProcess(tmp_path, roles_env)]):
            await all_settled(settings, results, worker.model, batch_id)

    assert_each_line_answered_once(results, batch_id)
    # A line forwarded just before the kill may be forwarded again (its mark in Redis
    # not yet written); the worker finds its final and does not run it twice.
    assert CRASH_LINES <= await queued(settings, worker.model) - before <= CRASH_LINES + 1


async def test_admission_members_joining_and_leaving_mid_batch_lose_and_repeat_nothing(
    settings: Settings,
    worker: WorkerProcess,
    producer: AIOKafkaProducer,
    roles_env: dict[str, str],
    results: ResultsReader,
    tmp_path: Path,
) -> None:
    """A second admission joins a quarter in (a rebalance), the first leaves at half (its
    partitions, the batch's among them if it still had it, move with lines in hand)."""
    key, _ = await batch_key(settings, "scaling-batcher")
    batch_id = f"scale-{uuid.uuid4().hex[:6]}"
    before = await queued(settings, worker.model)
    await send_lines(
        producer, key, batch_id, [question(worker.model, i) for i in range(CRASH_LINES)]
    )

    first, second = AdmissionProcess(tmp_path, roles_env), AdmissionProcess(tmp_path, roles_env)
    async with running([PersistProcess(tmp_path, roles_env), first]):
        await all_results(results, batch_id, CRASH_LINES // 4)
        async with running([second]):
            await all_results(results, batch_id, CRASH_LINES // 2)
            assert await asyncio.to_thread(first.terminate) == 0  # a clean leave
            await all_settled(settings, results, worker.model, batch_id)

    assert_each_line_answered_once(results, batch_id)
    assert await queued(settings, worker.model) - before == CRASH_LINES  # none forwarded twice


async def test_a_small_batch_is_not_held_back_by_another_tenants_flood(
    settings: Settings,
    worker: WorkerProcess,
    producer: AIOKafkaProducer,
    roles_env: dict[str, str],
    results: ResultsReader,
    tmp_path: Path,
) -> None:
    """The flood's lines are all queued ahead of the small batch's; with a fair share
    the small batch's 20 lines go out one for one with the flood's, so by the time the
    last of them is answered the flood has had about as many answered, not its whole
    backlog of lines."""
    flood_key, _ = await batch_key(settings, "flooder")
    small_key, _ = await batch_key(settings, "small-team")
    flood, small = f"flood-{uuid.uuid4().hex[:6]}", f"small-{uuid.uuid4().hex[:6]}"
    await send_lines(producer, flood_key, flood, [question(worker.model, i) for i in range(FLOOD)])
    env = {**roles_env, "TANDOOR_BATCH_BACKLOG_PER_WORKER": str(FAIR_BACKLOG)}
    async with running([AdmissionProcess(tmp_path, env), PersistProcess(tmp_path, env)]):
        await all_results(results, flood, 2 * FAIR_BACKLOG)  # the flood is flowing
        flood_before = len(results.of(flood))
        await send_lines(
            producer, small_key, small, [question(worker.model, i) for i in range(SMALL)]
        )
        await all_results(results, small, SMALL)
    flood_during = len(results.of(flood)) - flood_before
    print(f"while the small batch ran, the flood had {flood_during} lines answered")
    assert all(answered(r) for r in results.of(small))
    # One for one, plus what the band held when the small batch came and the lines a
    # slower reader may have counted late. In arrival order it would have been FLOOD.
    assert flood_during <= SMALL + 4 * FAIR_BACKLOG, flood_during


async def test_a_tenant_held_by_its_quota_does_not_stop_other_batches_being_read(
    settings: Settings,
    worker: WorkerProcess,
    producer: AIOKafkaProducer,
    roles_env: dict[str, str],
    results: ResultsReader,
    tmp_path: Path,
) -> None:
    """The buffer of lines read ahead is shared out by partition: one tenant's batch
    waiting on its quota (a request a minute) fills its partition's share, which is then
    read no further, and the other partitions are read on. Reading stopped for every
    batch while the held batch filled the buffer (for hours: it drains a line a minute)."""
    env, hog_key, _ = await slow_tenant(settings, roles_env)
    env["TANDOOR_ADMISSION_MAX_WAITING"] = str(2 * topics.BATCH_PARTITIONS)  # 2 a partition
    small_key, _ = await batch_key(settings, "small-batcher")
    hog = f"hog-{uuid.uuid4().hex[:6]}"
    small = batch_on_another_partition("small", than=hog)
    await send_lines(producer, hog_key, hog, [question(worker.model, i) for i in range(100)])
    async with running([AdmissionProcess(tmp_path, env), PersistProcess(tmp_path, env)]):
        await all_results(results, hog, 1)  # read: one line ran, 99 wait for the quota
        await send_lines(producer, small_key, small, [question(worker.model, i) for i in range(5)])
        got = await all_results(results, small, 5)
    assert all(answered(r) for r in got)
    assert len(results.of(hog)) < 10, "the held batch ran past its quota"


async def test_lines_held_by_the_quota_are_answered_at_once_on_a_cancel_or_the_window_end(
    settings: Settings,
    worker: WorkerProcess,
    producer: AIOKafkaProducer,
    roles_env: dict[str, str],
    results: ResultsReader,
    redis: aioredis.Redis,
    tmp_path: Path,
) -> None:
    """Lines waiting their turn (a tenant held by a quota of a request a minute) are
    answered `batch_cancelled` as soon as their batch is cancelled, and `batch_expired`
    as soon as its window ends. They were answered only at their turn, a line a minute
    here (hours for a big batch, forever with no worker), the batch `cancelling` meanwhile."""
    env, key, owner = await slow_tenant(settings, roles_env)
    held, late = (f"{name}-{uuid.uuid4().hex[:6]}" for name in ("held", "late"))
    lines = [question(worker.model, i) for i in range(HELD_LINES)]
    before = await queued(settings, worker.model)
    await send_lines(producer, key, held, lines)
    async with running([AdmissionProcess(tmp_path, env), PersistProcess(tmp_path, env)]):
        await all_results(results, held, 1)  # one line ran; the others wait for the quota
        await send_lines(producer, key, late, lines[:5], deadline_ms=now_ms() + 3_000)
        await redis.set(batch_cancel_key(owner, held), 1, ex=3600)  # the Batches API's cancel
        # A line a minute would leave 30 s without an answer.
        cancelled = await all_results(results, held, HELD_LINES, idle_s=30)
        expired = await all_results(results, late, 5, idle_s=30)
    assert sorted(r["custom_id"] for r in cancelled) == sorted(
        f"line-{i}" for i in range(HELD_LINES)
    )
    # One ran (two if a slow machine took a minute to cancel: the quota's next turn).
    ran = sum(r["error"] is None for r in cancelled)
    assert 1 <= ran <= 2, cancelled
    codes = Counter(r["error"]["code"] for r in cancelled + expired if r["error"])
    assert codes == {"batch_cancelled": HELD_LINES - ran, "batch_expired": 5}, codes
    assert await queued(settings, worker.model) - before == ran  # none other reached it


async def band_backlog(settings: Settings, model: str) -> int:
    """Prompts in the model's batch band past its workers' commits."""
    layout = BandLayout([(b.name, b.partitions) for b in settings.bands])
    batch = layout.band("batch").partitions
    async with backlog_clients(settings) as (admin, offsets):
        backlog, _ = await partition_backlog(admin, offsets, layout.total_partitions, model)
    return sum(n for p, n in backlog.items() if p in batch)


@contextlib.asynccontextmanager
async def watch_batch_band(settings: Settings, model: str) -> AsyncIterator[list[int]]:
    """Samples of the prompts in the model's batch band past its workers' commits."""
    layout = BandLayout([(b.name, b.partitions) for b in settings.bands])
    batch = layout.band("batch").partitions
    samples = [0]

    async def sample() -> None:
        async with backlog_clients(settings) as (admin, offsets):
            while True:
                backlog, _ = await partition_backlog(admin, offsets, layout.total_partitions, model)
                samples.append(sum(n for p, n in backlog.items() if p in batch))
                await asyncio.sleep(0.2)

    task = asyncio.create_task(sample())
    try:
        yield samples
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
