"""Two workers share a model's prompts; kill -9 of one mid-generation loses nothing (the
other continues the reply it had started), and SIGTERM of the other finishes what it can
within its grace period and hands back the rest. The package's worker is the survivor
(tests/integration/conftest.py): a second one joins its group to be killed."""

from __future__ import annotations

import asyncio
import re
import uuid
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer

from consumers.token_reader import TokenCollector
from infra.roles import WorkerProcess
from producers.control import request_cancel
from producers.prompts import PromptSubmitter
from schemas.events import ANSWERED, PromptRequest
from schemas.topics import BandLayout
from tandoor.clients import redis_client
from tandoor.settings import Settings
from tests.integration.conftest import SharedWorker
from tests.integration.pipeline import (
    all_committed,
    caught_up,
    committed_offset,
    end_offset,
    prompt,
)
from tests.waiting import until

pytestmark = pytest.mark.integration


def assigned_partitions(worker: WorkerProcess) -> set[int]:
    lines = re.findall(r"assigned \S+ partitions \[([\d, ]*)\]", worker.log())
    return {int(p) for p in lines[-1].split(",") if p.strip()} if lines else set()


def prompt_in(
    layout: BandLayout, partitions: set[int], model: str, text: str, max_tokens: int
) -> PromptRequest:
    """A paid prompt whose conversation lands in one of `partitions`."""
    while True:
        request = prompt(model, text, max_tokens=max_tokens, conversation_id=uuid.uuid4().hex)
        if layout.partition_for(request.band, request.conversation_id) in partitions:
            return request


async def test_kill_9_mid_generation_continues_on_the_other_worker(
    worker: WorkerProcess,
    shared_worker: SharedWorker,
    producer: AIOKafkaProducer,
    settings: Settings,
    tmp_path: Path,
) -> None:
    survivor, model = worker, worker.model
    layout = BandLayout([(b.name, b.partitions) for b in settings.bands])
    victim = WorkerProcess(model, tmp_path, shared_worker.env)
    victim.start()
    handed_back: PromptRequest | None = None
    try:
        await victim.wait_ready()
        held = await until(
            lambda: (assigned_partitions(survivor), assigned_partitions(victim)),
            lambda both: all(both) and not both[0] & both[1],
            what="the group spreading the partitions over both workers",
        )
        for partitions in held:  # every band is spread over both workers
            assert all(set(band.partitions) & partitions for band in layout.ranges), held
        async with TokenCollector(settings) as s:
            submitter = PromptSubmitter(settings, producer)
            victim_prompt = prompt_in(layout, held[1], model, "Tell me about the sea.", 100)
            others = [prompt(model, f"What is {i} + {i}?", max_tokens=24) for i in range(6)]
            for request in [victim_prompt, *others]:
                await submitter.submit(request)
            await s.first_token(victim_prompt.request_id)
            victim.kill()
            for request in [victim_prompt, *others]:
                await s.final(request.request_id)
            await all_committed(settings, model)  # the survivor is done with every prompt
            await caught_up(s, producer, settings)  # and we read all it published

            # SIGTERM with two requests in flight: the short one finishes within the
            # grace period (2 s: one step is left of it, over 100 ms on a slow CPU), the
            # one longer than that is handed back.
            handed_back = prompt(
                model, "Write a very long story.", max_tokens=1000, ignore_eos=True
            )
            back_partition = await submitter.submit(handed_back)
            elsewhere = set(layout.band(handed_back.band).partitions) - {back_partition}
            short = prompt_in(layout, elsewhere, model, "Name a colour.", 2)
            short_partition = await submitter.submit(short)
            await s.first_token(handed_back.request_id)
            await s.first_token(short.request_id)
            code = await asyncio.to_thread(survivor.terminate)
            await caught_up(s, producer, settings)  # all it published before exiting
    finally:
        victim.kill()
        if handed_back is not None:  # the next worker would continue it for minutes
            redis = redis_client(settings)
            await request_cancel(producer, redis, handed_back.request_id, "test over")
            await redis.aclose()

    assert code == 0, survivor.log()[-3000:]
    assert s.finals(short.request_id)[0].finish_reason in ANSWERED
    assert await committed_offset(settings, model, short_partition) == await end_offset(
        settings, model, short_partition
    )
    committed = await committed_offset(settings, model, back_partition)
    last = await end_offset(settings, model, back_partition) - 1  # the handed-back prompt
    assert committed is not None and committed <= last, "it must be redelivered"
    assert not s.finals(handed_back.request_id), "handed back, not finished"

    finals = s.finals(victim_prompt.request_id)
    assert [f.attempt for f in finals] == [1], "exactly one final, continuing attempt 1"
    assert f"{victim_prompt.request_id} attempt 2 continues attempt 1" in survivor.log()
    events = s.tokens(victim_prompt.request_id, 1)  # the victim's, then the survivor's
    by_seq = {t.seq: t.delta for t in events}
    for event in events:  # republished events say what the first said
        assert by_seq[event.seq] == event.delta, event
    assert sorted(by_seq) == list(range(len(by_seq)))
    assert "".join(by_seq[seq] for seq in sorted(by_seq)) == finals[0].text
    assert finals[0].usage.completion_tokens == sum(
        t.token_count for t in {t.seq: t for t in events}.values()
    )
    for request in others:  # nothing lost, and one reply: a final sent again is the same
        finals = s.finals(request.request_id)
        assert finals, request.request_id
        assert len({(f.attempt, f.text) for f in finals}) == 1, finals
