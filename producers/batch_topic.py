"""A client of the Kafka-native batch path: OpenAI batch-input lines onto
`batch.requests`, their results read back from `batch.results`. Any Kafka client can do
the same; this one serves the tests, the benchmarks and the HTTP Batches API."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import orjson
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError, KafkaTimeoutError

from schemas import topics
from schemas.batch import AUTHORIZATION_HEADER, BATCH_ID_HEADER, DEADLINE_HEADER
from tandoor.clients import TRANSACTION_TIMEOUT_MS

# All of a batch's lines are in Kafka within this, well before the broker would abort
# the transaction (TRANSACTION_TIMEOUT_MS), or none is: a 503.
QUEUE_LIMIT_S = 0.75 * TRANSACTION_TIMEOUT_MS / 1000
STOP_LIMIT_S = 10.0
COMMIT_WAIT_S = 10.0  # then the create answers, and the commit is waited for beside it
RESULT_PARTITIONS = [
    TopicPartition(topics.BATCH_RESULTS, p) for p in range(topics.BATCH_PARTITIONS)
]


def chat_line(custom_id: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


async def send_lines(
    producer: AIOKafkaProducer,
    api_key: str,
    batch_id: str,
    lines: Iterable[bytes],
    deadline_ms: int | None = None,
) -> int:
    """Produce raw lines (normally chat_line() as JSON) keyed by the batch id; returns
    how many. All are durably in Kafka when it returns. Lines not started by
    `deadline_ms` are answered as expired."""
    headers = [
        (AUTHORIZATION_HEADER, f"Bearer {api_key}".encode()),
        (BATCH_ID_HEADER, batch_id.encode()),
    ]
    if deadline_ms is not None:
        headers.append((DEADLINE_HEADER, str(deadline_ms).encode()))
    sent = [
        await producer.send(topics.BATCH_REQUESTS, line, key=batch_id.encode(), headers=headers)
        for line in lines
    ]
    for delivery in sent:
        await delivery
    return len(sent)


async def send_all_or_none(
    make_producer: Callable[[str], AIOKafkaProducer],
    api_key: str,
    batch_id: str,
    lines: Iterable[bytes],
    deadline_ms: int | None = None,
) -> int:
    """send_lines in one Kafka transaction, on a producer of its own (one transaction at
    a time per producer): admission reads committed records only, so it sees every
    line or none. A sender that fails or dies part-way leaves no line to run (a dead
    one's transaction is aborted by the broker after its timeout), where a client's
    retry ran the lines that had got out twice."""
    producer = make_producer(f"batch-{batch_id}")
    handed_on = False  # to the task that learns the commit's outcome: it stops the producer
    try:
        try:
            # aiokafka waits for the transaction's coordinator with no limit of its own.
            async with asyncio.timeout(QUEUE_LIMIT_S):
                await producer.start()
                await producer.begin_transaction()
                sent = await send_lines(producer, api_key, batch_id, lines, deadline_ms)
        except BaseException as exc:
            await _abort(producer)  # bounded: it too waits for the coordinator for ever
            if isinstance(exc, TimeoutError):
                raise KafkaTimeoutError(
                    f"the batch was not queued within {QUEUE_LIMIT_S} s"
                ) from exc
            raise
        commit = asyncio.ensure_future(producer.commit_transaction())
        await asyncio.wait({commit}, timeout=COMMIT_WAIT_S)
        if not commit.done():  # it may yet commit: no refusal, and it is waited for still
            handed_on = True
            raise CommitUnknown(batch_id, asyncio.ensure_future(_committed(producer, commit)))
        commit.result()  # a failed commit: nothing runs (the broker aborts it)
        return sent
    finally:
        if not handed_on:
            await _stop(producer)


class CommitUnknown(Exception):
    """The lines were sent and their commit asked for, with no answer yet: they may run.
    `committed` tells, once Kafka has (the broker aborts it after its timeout)."""

    def __init__(self, batch_id: str, committed: asyncio.Future[bool]) -> None:
        super().__init__(f"{batch_id}: the commit is not answered yet")
        self.committed = committed


async def _committed(producer: AIOKafkaProducer, commit: asyncio.Future[None]) -> bool:
    try:
        async with asyncio.timeout(TRANSACTION_TIMEOUT_MS / 1000):
            await commit
        return True
    except (TimeoutError, KafkaError):
        return False
    finally:
        await _stop(producer)


async def _stop(producer: AIOKafkaProducer) -> None:
    with contextlib.suppress(TimeoutError):  # what it sent is decided by now
        async with asyncio.timeout(STOP_LIMIT_S):
            await producer.stop()


async def _abort(producer: AIOKafkaProducer) -> None:
    """The transaction ended unsent (the broker would, after its timeout, anyway)."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(STOP_LIMIT_S):
            await producer.abort_transaction()


class ResultsReader:
    """Every result on `batch.results` from the moment start() ran, by batch id."""

    def __init__(self, bootstrap: str) -> None:
        self._consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
        self.results: dict[str, list[dict[str, Any]]] = {}

    async def start(self) -> None:
        await self._consumer.start()
        self._consumer.assign(RESULT_PARTITIONS)
        for tp, end in (await self._consumer.end_offsets(RESULT_PARTITIONS)).items():
            self._consumer.seek(tp, end)

    async def stop(self) -> None:
        await self._consumer.stop()

    async def poll(self) -> int:
        """Read what has arrived; returns how many results are known in all (copies
        included)."""
        batch = await self._consumer.getmany(timeout_ms=200, max_records=5000)
        for record in [r for chunk in batch.values() for r in chunk]:
            key = (record.key or b"").decode()
            self.results.setdefault(key, []).append(orjson.loads(record.value or b"null"))
        return sum(len(r) for r in self.results.values())

    def of(self, batch_id: str) -> list[dict[str, Any]]:
        """The batch's results, one per `id`: after a crash a result may come twice, and
        a client counting copies stopped waiting before its last lines were answered."""
        first: dict[object, dict[str, Any]] = {}
        for n, result in enumerate(self.copies(batch_id)):
            first.setdefault(result.get("id") or n, result)
        return list(first.values())

    def copies(self, batch_id: str) -> list[dict[str, Any]]:
        """Every result of the batch as it arrived, a repeated one as often as it came."""
        return self.results.get(batch_id, [])
