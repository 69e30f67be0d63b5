"""Stopping a prompt on the worker against real Kafka, Redis and vLLM: a cancel or a
deadline ends it at once wherever it is (streaming, waiting for the worker to take it,
or held inside the worker for token budget), with the usage it really had."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer

from consumers.token_reader import TokenCollector
from infra.roles import WorkerProcess
from producers.control import request_cancel
from producers.prompts import PromptSubmitter
from schemas.events import PromptRequest
from tandoor.clients import redis_client
from tandoor.policies.redis_keys import batch_cancel_key
from tandoor.settings import Settings
from tests.integration.pipeline import prompt
from tests.ops import samples
from tests.waiting import eventually, until

pytestmark = pytest.mark.integration


async def test_cancel_while_generating_keeps_partial_usage(
    worker: WorkerProcess, producer: AIOKafkaProducer, settings: Settings, redis_url: str
) -> None:
    client = redis_client(settings)
    try:
        async with TokenCollector(settings) as stream:
            request = prompt(
                worker.model,
                "Write a very long story about a dragon.",
                max_tokens=1000,
                ignore_eos=True,
            )
            await PromptSubmitter(settings, producer).submit(request)
            await stream.first_token(request.request_id)
            await request_cancel(producer, client, request.request_id, "stop button")
            final = await stream.final(request.request_id)
    finally:
        await client.aclose()
    assert final.finish_reason == "cancelled"
    assert 0 < final.usage.completion_tokens < 1000  # cut short, whatever the engine's speed
    assert final.text and final.usage.prompt_tokens > 0


async def test_cancel_before_the_worker_takes_the_prompt(
    worker: WorkerProcess, producer: AIOKafkaProducer, settings: Settings, redis_url: str
) -> None:
    client = redis_client(settings)
    request = prompt(worker.model, "Hello?", max_tokens=16)
    try:
        async with TokenCollector(settings) as stream:
            await request_cancel(producer, client, request.request_id)
            await PromptSubmitter(settings, producer).submit(request)
            final = await stream.final(request.request_id)
    finally:
        await client.aclose()
    assert final.finish_reason == "cancelled"
    assert final.usage.completion_tokens == 0 and not stream.tokens(request.request_id, 1)


@dataclass
class LongReply:
    """A long reply running on the worker, holding most of its token budget."""

    stream: TokenCollector
    submitter: PromptSubmitter
    control: aioredis.Redis
    request: PromptRequest


@contextlib.asynccontextmanager
async def long_reply_running(
    worker: WorkerProcess, producer: AIOKafkaProducer, settings: Settings
) -> AsyncIterator[LongReply]:
    """The long reply, streaming; cancelled (and its final awaited) at the end."""
    client = redis_client(settings)
    submitter = PromptSubmitter(settings, producer)
    try:
        async with TokenCollector(settings) as stream:
            long = prompt(
                worker.model, "Write a long essay about rivers.", max_tokens=1000, ignore_eos=True
            )
            await submitter.submit(long)
            await stream.first_token(long.request_id)
            yield LongReply(stream, submitter, client, long)
            await request_cancel(producer, client, long.request_id)
            await stream.final(long.request_id)
    finally:
        await client.aclose()


async def held_for_budget(
    worker: WorkerProcess, running: LongReply, waiting: PromptRequest
) -> None:
    """Taken by the worker and held for token budget: counted waiting, and the long reply
    goes on for three more events while it has none (it is counted waiting from when it
    is taken, before it reaches the budget: a cancel then raced its arrival's checks)."""
    await eventually(
        lambda: samples(worker),
        lambda found: found["tandoor_worker_requests_waiting"] >= 1,
        what="the prompt taken by the worker",
    )
    stream, long_id = running.stream, running.request.request_id
    seen = len(stream.tokens(long_id, 1))
    await until(
        lambda: len(stream.tokens(long_id, 1)), lambda n: n >= seen + 3, what="the long reply"
    )
    assert not stream.tokens(waiting.request_id, 1), "it was not held"


async def test_cancel_while_waiting_inside_the_worker(
    worker: WorkerProcess, producer: AIOKafkaProducer, settings: Settings, redis_url: str
) -> None:
    async with long_reply_running(worker, producer, settings) as running:
        stream = running.stream
        waiting = prompt(worker.model, "Write a poem.", max_tokens=500)  # does not fit
        await running.submitter.submit(waiting)
        await eventually(  # taken by the worker, held for lack of token budget
            lambda: samples(worker),
            lambda found: found["tandoor_worker_requests_waiting"] >= 1,
            what="the second prompt held in the worker",
        )
        assert not stream.tokens(waiting.request_id, 1)
        await request_cancel(producer, running.control, waiting.request_id)
        final = await stream.final(waiting.request_id)
        # At once: not when the long reply ends and frees the budget it waits for.
        long_id = running.request.request_id
        assert not stream.finals(long_id), "the cancel waited for the long reply"
    assert final.finish_reason == "cancelled"
    assert final.usage.completion_tokens == 0 and not stream.tokens(waiting.request_id, 1)


async def test_a_batch_cancelled_while_its_line_waits_inside_the_worker_does_not_run_it(
    worker: WorkerProcess, producer: AIOKafkaProducer, settings: Settings, redis_url: str
) -> None:
    """The batch's cancel was looked at when the line arrived only: one taken before the
    cancel and held for token budget ran once the budget was free, charged, answered 200."""
    async with long_reply_running(worker, producer, settings) as running:
        stream = running.stream
        batch_id = f"batch_{uuid.uuid4().hex}"
        waiting = prompt(worker.model, "Write a poem.", max_tokens=500, band="batch")
        waiting = waiting.model_copy(
            update={"kind": "batch", "batch_id": batch_id, "custom_id": "line-1"}
        )
        await running.submitter.submit(waiting)
        await held_for_budget(worker, running, waiting)
        # What the Batches API's cancel writes; no cancel event names the line.
        await running.control.set(batch_cancel_key(waiting.user_id, batch_id), 1, ex=600)
        await request_cancel(producer, running.control, running.request.request_id)
        final = await stream.final(waiting.request_id)  # once the long reply freed the budget
    assert final.finish_reason == "cancelled"
    assert final.usage.completion_tokens == 0 and not stream.tokens(waiting.request_id, 1)


async def test_a_prompt_waiting_inside_the_worker_expires_at_its_deadline(
    worker: WorkerProcess, producer: AIOKafkaProducer, settings: Settings, redis_url: str
) -> None:
    """Held for token budget while a long reply runs: answered `expired` when its
    deadline passes, not minutes later when the long reply frees the budget (the
    gateway would have told the client by then that no worker answered)."""
    async with long_reply_running(worker, producer, settings) as running:
        stream = running.stream
        deadline_ms = int(time.time() * 1000) + 5_000  # ample to be taken before it
        waiting = prompt(worker.model, "Write a poem.", max_tokens=500, deadline_ms=deadline_ms)
        await running.submitter.submit(waiting)
        final = await stream.final(waiting.request_id)
        assert not stream.finals(running.request.request_id), (
            "the deadline waited for the long reply"
        )
    assert final.finish_reason == "expired"
    assert final.error == "the deadline passed in the worker's queue"  # taken, then held
    assert final.usage.completion_tokens == 0 and not stream.tokens(waiting.request_id, 1)


async def test_expired_prompt_never_reaches_the_engine(
    worker: WorkerProcess, producer: AIOKafkaProducer, settings: Settings
) -> None:
    async with TokenCollector(settings) as stream:
        request = prompt(worker.model, "Too late.", deadline_ms=int(time.time() * 1000) - 1)
        await PromptSubmitter(settings, producer).submit(request)
        final = await stream.final(request.request_id)
    assert final.finish_reason == "expired" and "deadline" in (final.error or "")
    assert final.usage.prompt_tokens == 0 and final.usage.completion_tokens == 0
