"""A 96-prompt batch end to end: submit (interrupted, then resumed), a real worker (the
package's) and the persistence consumer, then collect in input order with usage and
errors."""

from __future__ import annotations

import uuid
from pathlib import Path

import orjson
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from infra.roles import PersistProcess, WorkerProcess, running
from infra.topics import start_group_at_end
from producers.batch import CHUNK, BatchClient, BatchError
from schemas.topics import prompts_topic
from tandoor.policies.api_keys import create_key
from tandoor.settings import Settings

pytestmark = pytest.mark.integration
LINES = CHUNK + CHUNK // 2  # the resumed submission sends the second, partial chunk
TOO_LONG = 7  # this line cannot fit the model's context: it fails, the rest do not


class Interrupted(Exception):
    pass


def stop_after_first_chunk(done: int, total: int) -> None:
    if done < total:
        raise Interrupted


async def queued(settings: Settings, model: str) -> int:
    """How many prompts were ever produced to the model's topic."""
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap)
    await consumer.start()
    try:
        partitions = sum(band.partitions for band in settings.bands)
        tps = [TopicPartition(prompts_topic(model), p) for p in range(partitions)]
        return sum((await consumer.end_offsets(tps)).values())
    finally:
        await consumer.stop()


def write_batch(path: Path) -> None:
    lines = [
        {"prompt": f"What is {i} + {i}? Reply with the number.", "max_tokens": 10}
        for i in range(LINES)
    ]
    lines[TOO_LONG] = {"messages": [{"role": "user", "content": "word " * 4000}], "max_tokens": 8}
    path.write_bytes(b"\n".join(orjson.dumps(line) for line in lines) + b"\n")


async def test_a_batch_resumes_without_duplicates_and_collects_in_order(
    settings: Settings, worker: WorkerProcess, tmp_path: Path
) -> None:
    model = worker.model
    settings = settings.model_copy(update={"models": [model]})
    group = f"persist-batch-{uuid.uuid4().hex[:8]}"
    await start_group_at_end(settings, group)
    persist = PersistProcess(tmp_path, {"TANDOOR_PERSIST_GROUP": group})
    _, caller = await create_key(settings, f"batcher-{uuid.uuid4().hex[:8]}", "batch")
    client = BatchClient(settings, caller)
    source, out = tmp_path / "prompts.jsonl", tmp_path / "results.jsonl"
    write_batch(source)

    before = await queued(settings, model)  # the worker serves other tests too
    with pytest.raises(Interrupted):
        await client.submit(source, model, stop_after_first_chunk)
    assert await queued(settings, model) - before == CHUNK
    batch_id = await client.submit(source, model)  # the same file resumes the same batch
    assert await client.submit(source, model) == batch_id
    assert await queued(settings, model) - before == LINES, "no line was queued twice"

    _, stranger = await create_key(settings, f"other-{uuid.uuid4().hex[:8]}", "batch")
    with pytest.raises(BatchError, match="not found"):
        await BatchClient(settings, stranger).collect(batch_id, out, wait_s=0)

    async with running([persist]):
        done = await client.collect(batch_id, out, wait_s=120)  # waits while lines come
    assert (done.lines, done.answered, done.failed) == (LINES, LINES, 1)

    results = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert [r["line"] for r in results] == list(range(LINES))
    assert "error" in results[TOO_LONG] and results[TOO_LONG]["finish_reason"] == "error"
    answered = [r for r in results if "error" not in r]
    assert len(answered) == LINES - 1
    assert all(r["text"] and r["usage"]["completion_tokens"] >= 1 for r in answered)
    # Each answer sits on its own line: most repeat the question or give the sum.
    right = sum(
        f"{r['line']} + {r['line']}" in r["text"] or str(2 * r["line"]) in r["text"]
        for r in answered
    )
    assert right > LINES // 2, f"only {right} answers match their line"
