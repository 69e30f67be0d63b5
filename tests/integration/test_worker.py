"""The inference worker against real Kafka, Redis and vLLM with the bundled model (the
package's shared worker: tests/integration/conftest.py)."""

from __future__ import annotations

import asyncio
import re
import subprocess
import urllib.request
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import ConsumerRecord

from consumers.token_reader import TokenCollector
from infra.roles import WorkerProcess
from producers.prompts import PromptSubmitter
from schemas import topics
from schemas.codec import decode, encode
from schemas.events import ANSWERED, MessageKey, UsageRecord, now_ms
from tandoor.clients import assign_from_end, redis_client
from tandoor.policies.redis_keys import ATTEMPT_TTL_S, attempt_key, lease_key, reply_key
from tandoor.settings import Settings
from tests.integration.conftest import COALESCE_TOKENS, CONTEXT_TOKENS, MAX_SEQS
from tests.integration.pipeline import all_committed, caught_up, prompt
from tests.ops import samples
from tests.waiting import eventually
from workers.coalesce import OPENING_EVENTS

pytestmark = pytest.mark.integration


async def test_reply_streams_in_order_then_final_and_usage(
    worker: WorkerProcess, producer: AIOKafkaProducer, settings: Settings
) -> None:
    usage = await _usage_reader(settings)
    try:
        async with TokenCollector(settings) as stream:
            request = prompt(worker.model, "What is the capital of France?", max_tokens=48)
            replaced = MessageKey(created_at_ms=request.created_at_ms - 5000, message_id="r-old")
            request = request.model_copy(update={"replaces": [replaced]})  # a regenerate's
            await PromptSubmitter(settings, producer).submit(request)
            final = await stream.final(request.request_id)
            tokens = stream.tokens(request.request_id, 1)
        record = await _usage_for(usage, request.request_id)
    finally:
        await usage.stop()
    assert final.finish_reason in ANSWERED and final.attempt == 1
    assert final.replaces == [replaced]  # for persistence to hide (the gateway may be gone)
    assert "Paris" in final.text
    assert [t.seq for t in tokens] == list(range(len(tokens)))
    assert final.seq == len(tokens)
    assert "".join(t.delta for t in tokens) == final.text
    completion = sum(t.token_count for t in tokens)
    assert completion == final.usage.completion_tokens > COALESCE_TOKENS + 1
    # What the engine gives goes out at once until the first word has ended (what a
    # reader sees first); then every COALESCE_TOKENS. The engine gives one token a step,
    # or more where the worker read it late (vLLM merges what waited): at least.
    counts = [t.token_count for t in tokens]
    opening = next(
        i
        for i in range(1, len(tokens) + 1)
        if re.search(r"\S\s", "".join(t.delta for t in tokens[:i])) or i == OPENING_EVENTS
    )
    assert sum(counts[:opening]) < COALESCE_TOKENS * opening, counts  # not held back
    assert all(c >= COALESCE_TOKENS for c in counts[opening:-1]), counts
    assert counts[-1] >= 1, counts
    assert final.usage.prompt_tokens > 5 and final.usage.ttft_ms is not None
    assert (record.prompt_tokens, record.completion_tokens) == (
        final.usage.prompt_tokens,
        final.usage.completion_tokens,
    )
    assert record.finish_reason == final.finish_reason


async def test_high_band_overtakes_a_flooded_low_band(
    worker: WorkerProcess, producer: AIOKafkaProducer, settings: Settings
) -> None:
    submitter = PromptSubmitter(settings, producer)
    async with TokenCollector(settings) as stream:
        flood = [
            prompt(worker.model, f"Count from 1 to {20 + i}.", band="batch", max_tokens=24)
            for i in range(2 * MAX_SEQS)
        ]
        for request in flood:
            await submitter.submit(request)
        # The worker is busy with batch work. Any of it: which prompts it takes first
        # depends on the partitions their ids hash to (flood[0] may come last).
        await stream.wait_for(
            lambda: any(stream.tokens(r.request_id, 1) for r in flood), "the batch under way"
        )
        urgent = prompt(worker.model, "Say hello.", band="interactive-paid", max_tokens=16)
        await submitter.submit(urgent)
        await stream.final(urgent.request_id)
        for request in flood:
            await stream.final(request.request_id)
    urgent_done = stream.arrival[urgent.request_id]
    after = [r for r in flood if stream.arrival[r.request_id] > urgent_done]
    assert len(after) >= len(flood) // 2, "the paid prompt should overtake most of the batch"
    assert all(stream.finals(r.request_id)[0].finish_reason != "error" for r in flood)


async def test_a_reply_goes_on_when_redis_loses_its_lease(
    worker: WorkerProcess, producer: AIOKafkaProducer, settings: Settings, redis_url: str
) -> None:
    """Redis restarted empty mid-reply (the deployed Redis keeps nothing on disk): the
    worker took that for another worker taking over, stopped, and committed the prompt;
    the reply was lost and the client waited out the silence limit."""
    client = redis_client(settings)
    request = prompt(
        worker.model, "Write a very long story about a dragon.", max_tokens=160, ignore_eos=True
    )
    rid = request.request_id
    try:
        async with TokenCollector(settings) as stream:
            await PromptSubmitter(settings, producer).submit(request)
            await stream.first_token(rid)
            await client.delete(lease_key(rid), attempt_key(rid), reply_key(rid))
            at_loss = len(stream.tokens(rid, 1))
            final = await stream.final(rid)
            tokens = stream.tokens(rid, 1)
    finally:
        await client.aclose()
    assert final.finish_reason in ANSWERED, final
    assert len(tokens) > at_loss, "no text after the loss"
    assert "".join(t.delta for t in tokens) == final.text
    assert len(stream.finals(rid)) == 1


async def test_bad_input_gets_errors_and_the_worker_keeps_running(
    worker: WorkerProcess, producer: AIOKafkaProducer, settings: Settings
) -> None:
    submitter = PromptSubmitter(settings, producer)
    topic = topics.prompts_topic(worker.model)
    dead = await _dead_letter_reader(settings)
    try:
        async with TokenCollector(settings) as stream:
            wrong_model = prompt(worker.model, "hi").model_copy(update={"model": "no-such-model"})
            await producer.send_and_wait(topic, encode(wrong_model), partition=0)
            too_long = prompt(worker.model, "word " * 5000)
            await submitter.submit(too_long)
            await producer.send_and_wait(topic, b"\xff not json", partition=0)
            await producer.send_and_wait(topic, b'{"v": 1, "request_id": "bad-1"}', partition=0)
            # Reply partitions `tokens` does not have (forged, or tokens grown since the
            # worker last looked): once, aiokafka's own check stopped the worker, and the
            # malformed one, never committed, stopped every worker that took it after.
            nowhere = b'{"v": 1, "request_id": "bad-2", "reply_partition": 1000000}'
            await producer.send_and_wait(topic, nowhere, partition=0)
            lost = prompt(worker.model, "Hello.", max_tokens=4).model_copy(
                update={"reply_partition": 1_000_000}
            )
            await submitter.submit(lost)
            healthy = prompt(worker.model, "What is 2 + 2?", max_tokens=16)
            await submitter.submit(healthy)
            ids = (
                wrong_model.request_id,
                too_long.request_id,
                "bad-1",
                "bad-2",
                lost.request_id,
                healthy.request_id,
            )
            finals = {r: await stream.final(r) for r in ids}
        letters = await _records(dead, 3)
    finally:
        await dead.stop()
    assert worker.proc is not None and worker.proc.poll() is None, "the worker stopped"
    assert finals[lost.request_id].finish_reason in ANSWERED  # on its key's partition
    assert "malformed prompt" in (finals["bad-2"].error or "")
    assert "unknown model 'no-such-model'" in (finals[wrong_model.request_id].error or "")
    # The window configured for the model (TANDOOR_MODELS) is the engine's.
    assert f"context window of {worker.model} is {CONTEXT_TOKENS} tokens" in (
        finals[too_long.request_id].error or ""
    )
    assert "malformed prompt" in (finals["bad-1"].error or "")
    assert finals[healthy.request_id].finish_reason in ANSWERED
    # Both dead-lettered, each once (the worker sends them concurrently: any order).
    assert sorted(r.value for r in letters) == sorted(
        [b"\xff not json", b'{"v": 1, "request_id": "bad-1"}', nowhere]
    )
    assert all(dict(r.headers)["error"] for r in letters)


async def test_ask_command_streams_a_reply(worker: WorkerProcess) -> None:
    argv = ["tandoor", "ask", "What is the capital of France?", "--model", worker.model]
    # With the worker's settings: the command refuses a model they do not serve.
    result = await asyncio.to_thread(
        subprocess.run, argv, capture_output=True, text=True, timeout=120, env=worker.env
    )
    assert result.returncode == 0, result.stderr
    reply, summary = result.stdout.strip().splitlines()[-2:]
    assert "Paris" in reply
    assert summary.startswith("[stop]") and "completion tokens" in summary
    # A reply that failed fails the command (a smoke test passed on it).
    too_long = [*argv[:2], "word " * 5_000, *argv[3:]]
    result = await asyncio.to_thread(
        subprocess.run, too_long, capture_output=True, text=True, timeout=120, env=worker.env
    )
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert result.stdout.strip().splitlines()[-1].startswith("[error]")


async def test_a_repeated_prompt_is_served_from_the_prefix_cache(
    worker: WorkerProcess, producer: AIOKafkaProducer, settings: Settings
) -> None:
    # A prefix no other prompt shares (the id), long enough to fill several KV blocks.
    text = f"Case {uuid.uuid4().hex}. " + "The quick brown fox jumps over the lazy dog. " * 60
    before = await samples(worker)
    usage = await _usage_reader(settings)
    try:
        async with TokenCollector(settings) as stream:
            finals = []
            for _ in range(2):  # one after the other: the second finds the first's blocks
                request = prompt(worker.model, text + "Summarize.", max_tokens=4)
                await PromptSubmitter(settings, producer).submit(request)
                finals.append(await stream.final(request.request_id))
        records = [await _usage_for(usage, final.request_id) for final in finals]
    finally:
        await usage.stop()
    first, second = (final.usage for final in finals)
    assert first.prompt_tokens == second.prompt_tokens > 500
    assert first.cached_tokens == 0
    assert 0 < second.cached_tokens < second.prompt_tokens
    assert [r.cached_tokens for r in records] == [0, second.cached_tokens]  # usage stream
    after = await samples(worker)
    cached = "tandoor_worker_cached_prompt_tokens_total"
    assert after[cached] - before.get(cached, 0) >= second.cached_tokens
    prompted = "tandoor_worker_prompt_tokens_total"
    assert after[prompted] - before.get(prompted, 0) >= 2 * first.prompt_tokens


async def test_metrics_endpoint(worker: WorkerProcess) -> None:
    url = f"http://127.0.0.1:{worker.ops_port()}/metrics"
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    for name in (
        "tandoor_worker_requests_waiting",
        "tandoor_worker_requests_running",
        "tandoor_worker_time_to_first_token_seconds_bucket",
        "tandoor_worker_generated_tokens_total",
        "tandoor_worker_consumer_lag",
    ):
        assert name in body, name


async def _usage_reader(settings: Settings) -> AIOKafkaConsumer:
    return await _reader_from_end(settings, topics.USAGE)


async def _dead_letter_reader(settings: Settings) -> AIOKafkaConsumer:
    return await _reader_from_end(settings, topics.DEAD_LETTER)


async def _reader_from_end(settings: Settings, topic: str) -> AIOKafkaConsumer:
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap, fetch_max_wait_ms=5)
    await consumer.start()
    await assign_from_end(consumer, topic)
    return consumer


async def _records(consumer: AIOKafkaConsumer, count: int) -> list[ConsumerRecord[bytes, bytes]]:
    records: list[ConsumerRecord[bytes, bytes]] = []

    async def read() -> int:
        batch = await consumer.getmany(timeout_ms=500)
        records.extend(r for chunk in batch.values() for r in chunk)
        return len(records)

    await eventually(read, lambda n: n >= count, what=f"{count} records")
    return records


async def _usage_for(consumer: AIOKafkaConsumer, request_id: str) -> UsageRecord:
    found: dict[str, UsageRecord] = {}

    async def read() -> UsageRecord | None:
        for chunk in (await consumer.getmany(timeout_ms=500)).values():
            for record in chunk:
                usage = decode(UsageRecord, record.value)
                found[usage.request_id] = usage
        return found.get(request_id)

    usage = await eventually(read, what=f"the usage record of {request_id}")
    assert usage is not None
    return usage


async def test_a_prompt_read_after_its_done_mark_is_gone_is_passed_over(
    worker: WorkerProcess, producer: AIOKafkaProducer, settings: Settings
) -> None:
    """Finished but not committed (behind a longer prompt), then read again over a day
    later, when its done mark had expired: it was answered a second time, `expired`,
    and that empty final could replace the stored reply. Its deadline long past, it is
    passed over; a prompt after it on its partition is answered as usual."""
    made = now_ms() - (ATTEMPT_TTL_S + 3600) * 1000
    old = prompt(worker.model, "Hi", deadline_ms=made + 60_000)
    old = old.model_copy(update={"created_at_ms": made})
    after = prompt(worker.model, "What is 2 + 2?", conversation_id=old.conversation_id)
    async with TokenCollector(settings) as stream:
        submitter = PromptSubmitter(settings, producer)
        for request in (old, after):
            await submitter.submit(request)
        assert (await stream.final(after.request_id)).finish_reason in ANSWERED
        await all_committed(settings, worker.model)  # the old one was handled, before
        await caught_up(stream, producer, settings)  # all published since: read
    assert not stream.finals(old.request_id)
