"""Two workers share a model's prompts; kill -9 of one mid-generation loses nothing."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from pathlib import Path

import pytest

from consumers.token_reader import TokenCollector
from infra.roles import WorkerProcess
from infra.topics import TopicSpec, ensure_topics
from producers.prompts import PromptSubmitter
from schemas import topics
from schemas.topics import BandLayout
from tandoor.clients import kafka_producer
from tandoor.settings import Settings
from tests.integration.pipeline import committed_offset, end_offset, prompt
from workers.model_store import resolve_model_dir

pytestmark = pytest.mark.integration


def assigned_partitions(worker: WorkerProcess) -> set[int]:
    lines = re.findall(r"assigned \S+ partitions \[([\d, ]*)\]", worker.log())
    return {int(p) for p in lines[-1].split(",") if p.strip()} if lines else set()


async def test_kill_9_mid_generation_reruns_on_the_other_worker(
    kafka: str, redis_url: str, settings: Settings, tmp_path: Path
) -> None:
    model = f"wb-{uuid.uuid4().hex[:6]}"
    layout = BandLayout([(b.name, b.partitions) for b in settings.bands])
    await ensure_topics(kafka, [TopicSpec(topics.prompts_topic(model), layout.total_partitions)])
    model_dir = await asyncio.to_thread(resolve_model_dir, "smollm2", settings)
    env = {"TANDOOR_MODEL_DIRS": json.dumps({model: str(model_dir)}), "TANDOOR_WORKER_GRACE_S": "2"}
    workers = [WorkerProcess(model, tmp_path, env) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        await asyncio.gather(*(w.wait_ready() for w in workers))
        await _until(lambda: all(assigned_partitions(w) for w in workers))
        for w in workers:  # the group spreads every band over both workers
            held = assigned_partitions(w)
            assert all(set(band.partitions) & held for band in layout.ranges), held
        async with (
            kafka_producer(settings, "crash-test") as producer,
            TokenCollector(settings) as s,
        ):
            submitter = PromptSubmitter(settings, producer)
            victim_prompt = prompt(model, "Tell me a long story about the sea.", max_tokens=300)
            others = [prompt(model, f"What is {i} + {i}?", max_tokens=24) for i in range(6)]
            partition = await submitter.submit(victim_prompt)
            for other in others:
                await submitter.submit(other)
            await s.first_token(victim_prompt.request_id)
            victim = next(w for w in workers if partition in assigned_partitions(w))
            victim.kill()
            survivor = next(w for w in workers if w is not victim)
            for request in [victim_prompt, *others]:
                await s.final(request.request_id)
            await asyncio.sleep(1)  # a duplicate final would arrive now

            # SIGTERM with a request longer than the grace period: it is handed back.
            handed_back = prompt(model, "Write a very long story.", max_tokens=1000)
            back_partition = await submitter.submit(handed_back)
            await s.first_token(handed_back.request_id)
            assert await asyncio.to_thread(survivor.terminate) == 0
            await asyncio.sleep(1)
        committed = await committed_offset(settings, model, back_partition)
        last = await end_offset(settings, model, back_partition) - 1  # the handed-back prompt
        assert committed is not None and committed <= last, "it must be redelivered"
        assert not s.finals(handed_back.request_id), "handed back, not finished"
    finally:
        for w in workers:
            if w.proc is not None and w.proc.poll() is None:
                w.kill()

    finals = s.finals(victim_prompt.request_id)
    assert [f.attempt for f in finals] == [2], "exactly one final, from the second attempt"
    rerun = s.tokens(victim_prompt.request_id, 2)
    assert [t.seq for t in rerun] == list(range(len(rerun)))
    assert "".join(t.delta for t in rerun) == finals[0].text
    assert s.tokens(victim_prompt.request_id, 1), "the first attempt had streamed"
    for request in others:  # nothing lost, nothing answered twice per attempt
        attempts = [f.attempt for f in s.finals(request.request_id)]
        assert attempts and len(attempts) == len(set(attempts)), attempts


async def _until(condition: object, timeout_s: float = 60) -> None:
    assert callable(condition)
    for _ in range(int(timeout_s / 0.2)):
        if condition():
            return
        await asyncio.sleep(0.2)
    raise AssertionError("condition not met in time")
