"""Hostile records on `batch.requests`, which any Kafka client can write. A record whose
header name is not UTF-8 is taken by the broker, but aiokafka cannot parse it: the
admission role stopped on it, and again after every restart, so every batch behind it
waited for good. Now admission steps over it, notes it on the dead-letter topic, and
every good line (before and after it on its partition, and on the others) is answered
once."""

from __future__ import annotations

import contextlib
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import orjson
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.producer import message_accumulator
from aiokafka.producer import producer as producer_module
from aiokafka.record.default_records import _DefaultRecordBatchBuilderPy

from infra.roles import AdmissionProcess, PersistProcess, WorkerProcess, running
from producers.batch_topic import ResultsReader, chat_line, send_lines
from schemas import topics
from schemas.batch import AUTHORIZATION_HEADER
from tandoor.clients import assign_from_end
from tandoor.settings import Settings
from tests.integration.batch_lines import (
    all_results,
    answered,
    batch_key,
    batch_on_another_partition,
    partition_of,
    question,
)
from tests.waiting import eventually

pytestmark = pytest.mark.integration


class NotUtf8(str):
    """A header name that encodes to bytes no UTF-8 decoder accepts."""

    def encode(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        return b"\xff\xfe-name"


@contextlib.contextmanager
def python_record_builder() -> Iterator[None]:
    """aiokafka's pure-Python batch builder, which calls the name's own encode()."""
    modules = (producer_module, message_accumulator)
    compiled = [module.DefaultRecordBatchBuilder for module in modules]
    for module in modules:
        module.DefaultRecordBatchBuilder = _DefaultRecordBatchBuilderPy
    try:
        yield
    finally:
        for module, builder in zip(modules, compiled, strict=True):
            module.DefaultRecordBatchBuilder = builder


async def send_unreadable(settings: Settings, api_key: str, batch_id: str) -> int:
    """One record with a non-UTF-8 header name, keyed like the batch; returns its offset."""
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap)
    await producer.start()
    try:
        with python_record_builder():
            headers = [(AUTHORIZATION_HEADER, f"Bearer {api_key}".encode()), (NotUtf8(), b"1")]
            sent = await producer.send_and_wait(
                topics.BATCH_REQUESTS, b"{}", key=batch_id.encode(), headers=headers
            )
    finally:
        await producer.stop()
    return int(sent.offset)


@contextlib.asynccontextmanager
async def dead_letters(settings: Settings) -> AsyncIterator[Callable[[], Awaitable[list[str]]]]:
    """Where each dead letter written from now on came from (its `source` header)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap, fetch_max_wait_ms=50)
    await consumer.start()
    sources: list[str] = []

    async def read() -> list[str]:
        batch = await consumer.getmany(timeout_ms=500)
        records = [r for chunk in batch.values() for r in chunk]
        sources.extend(dict(r.headers).get("source", b"").decode() for r in records)
        return sources

    try:
        await assign_from_end(consumer, topics.DEAD_LETTER)
        yield read
    finally:
        await consumer.stop()


async def test_a_record_aiokafka_cannot_parse_is_stepped_over_and_no_line_is_lost(
    settings: Settings,
    worker: WorkerProcess,
    producer: AIOKafkaProducer,
    roles_env: dict[str, str],
    results: ResultsReader,
    tmp_path: Path,
) -> None:
    key, _ = await batch_key(settings, "hostile-neighbour")
    poisoned = f"poisoned-{uuid.uuid4().hex[:6]}"
    other = batch_on_another_partition("other", than=poisoned)
    await send_lines(producer, key, poisoned, [question(worker.model, i) for i in range(3)])
    offset = await send_unreadable(settings, key, poisoned)
    await send_lines(producer, key, poisoned, [question(worker.model, i) for i in range(3, 5)])
    await send_lines(producer, key, other, [question(worker.model, i) for i in range(2)])

    roles = [AdmissionProcess(tmp_path, roles_env), PersistProcess(tmp_path, roles_env)]
    async with dead_letters(settings) as letters, running(roles):
        got = await all_results(results, poisoned, 5)
        got_other = await all_results(results, other, 2)
        source = f"{topics.BATCH_REQUESTS}/{partition_of(poisoned)}/{offset}"
        await eventually(
            letters,
            lambda sources: source in sources,
            what=f"a dead letter from {source}",
        )
    by_id = Counter(r["custom_id"] for r in got)
    assert by_id == Counter(f"line-{i}" for i in range(5)), by_id  # each once, none lost
    assert all(answered(r) for r in [*got, *got_other])


async def test_a_batch_id_near_kafkas_record_limit_is_refused_and_lines_behind_it_run(
    settings: Settings,
    worker: WorkerProcess,
    producer: AIOKafkaProducer,
    roles_env: dict[str, str],
    results: ResultsReader,
    tmp_path: Path,
) -> None:
    """Its refusal keyed by the whole id would not fit a record: retried for good, it
    stopped admission on every partition."""
    key, _ = await batch_key(settings, "long-id")
    after = f"after-{uuid.uuid4().hex[:6]}"
    # The record fits the broker's limit; its answer, keyed by the same id, would not.
    huge_id = b"x" * 1_048_300
    big = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap, max_request_size=2**21)
    await big.start()
    try:
        headers = [(AUTHORIZATION_HEADER, f"Bearer {key}".encode())]
        await big.send_and_wait(
            topics.BATCH_REQUESTS,
            b"{}",
            key=huge_id,
            headers=headers,
            partition=partition_of(after),
        )
    finally:
        await big.stop()
    await send_lines(producer, key, after, [question(worker.model, i) for i in range(2)])

    roles = [AdmissionProcess(tmp_path, roles_env), PersistProcess(tmp_path, roles_env)]
    async with running(roles):
        got = await all_results(results, after, 2)
        (refused,) = await all_results(results, "", 1)  # too long to be a key: none
    assert all(answered(r) for r in got)
    assert refused["response"]["status_code"] == 400, refused
    assert "1048300 characters" in refused["response"]["body"]["error"]["message"]


async def test_refusals_that_would_echo_huge_input_are_answered_and_lines_behind_them_run(
    settings: Settings,
    worker: WorkerProcess,
    producer: AIOKafkaProducer,
    roles_env: dict[str, str],
    results: ResultsReader,
    tmp_path: Path,
) -> None:
    """A refusal quoted the line's model name, or the name of a field it does not know,
    whole: a 320 KB name became an answer past Kafka's record limit (each character
    escaped twice), retried each second for good in front of every line behind it."""
    key, _ = await batch_key(settings, "echoes")
    batch_id = f"echoes-{uuid.uuid4().hex[:6]}"
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    odd_model = chat_line("odd-model", {**body, "model": "\u0378" * 160_000})
    odd_field = chat_line("odd-field", {**body, "model": worker.model, "f" * 900_000: 1})
    hostile = [orjson.dumps(odd_model), orjson.dumps(odd_field)]
    good = [question(worker.model, i) for i in range(2)]
    await send_lines(producer, key, batch_id, [*hostile, *good])

    roles = [AdmissionProcess(tmp_path, roles_env), PersistProcess(tmp_path, roles_env)]
    async with running(roles):
        got = {r["custom_id"]: r for r in await all_results(results, batch_id, 4)}
    assert sorted(got) == ["line-0", "line-1", "odd-field", "odd-model"]
    assert answered(got["line-0"]) and answered(got["line-1"])
    for refused, status in [(got["odd-model"], 404), (got["odd-field"], 400)]:
        assert refused["response"]["status_code"] == status, refused
        assert len(orjson.dumps(refused)) < 4_000
