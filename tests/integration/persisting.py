"""What the persistence tests share: finals as a worker writes them, a `tandoor persist`
of a group of its own, the rows it stored and the dead letters it sent."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import ConsumerRecord

from infra.roles import PersistProcess
from infra.topics import start_group_at_end
from schemas import topics
from schemas.codec import encode
from schemas.events import (
    FinalEvent,
    FinishReason,
    PromptKind,
    Usage,
    now_ms,
)
from tandoor.clients import assign_from_end, cassandra_session
from tandoor.settings import Settings
from tests.waiting import eventually


@pytest.fixture
def keyspace(migrated_keyspace: str) -> str:
    return migrated_keyspace


@pytest.fixture
async def persist_env(kafka: str, settings: Settings, keyspace: str, unique: str) -> dict[str, str]:
    """A group of its own, starting at the end of `tokens`: every test starts persist
    before publishing, and a replay of what other tests left there only slows it."""
    group = f"persist-{unique}"
    await start_group_at_end(settings, group)
    return {"TANDOOR_KEYSPACE": keyspace, "TANDOOR_PERSIST_GROUP": group}


def final(
    conversation: str,
    text: str,
    *,
    reason: FinishReason = "stop",
    attempt: int = 1,
    request_id: str | None = None,
    prompt_at: int | None = None,
    kind: PromptKind = "chat",
) -> FinalEvent:
    return FinalEvent(
        kind=kind,
        request_id=request_id or f"req-{uuid.uuid4().hex[:10]}",
        attempt=attempt,
        seq=3,
        finish_reason=reason,
        text=text,
        usage=Usage(
            prompt_tokens=11,
            completion_tokens=len(text.split()),
            queue_ms=1,
            ttft_ms=20,
            decode_ms=50,
        ),
        model="smollm2",
        user_id="alice",
        tier="plus",
        conversation_id=conversation,
        created_at_ms=now_ms(),
        prompt_created_at_ms=prompt_at or now_ms() - 1000,
    )


async def publish(producer: AIOKafkaProducer, *events: FinalEvent) -> None:
    for event in events:
        await producer.send_and_wait(topics.TOKENS, encode(event), key=event.request_id.encode())


def select_rows(
    settings: Settings, keyspace: str, query: str, params: tuple[Any, ...]
) -> list[Any]:
    with cassandra_session(settings, keyspace) as session:
        return list(session.execute(query, params))


def messages(settings: Settings, keyspace: str, conversation: str) -> list[Any]:
    query = (
        "SELECT message_id, content, status, attempt, created_at, completion_tokens, "
        "finish_reason FROM messages_by_conversation WHERE conversation_id = %s"
    )
    return select_rows(settings, keyspace, query, (conversation,))


async def wait_rows(settings: Settings, keyspace: str, conversation: str, count: int) -> list[Any]:
    return await eventually(
        lambda: asyncio.to_thread(messages, settings, keyspace, conversation),
        lambda rows: len(rows) >= count,
        what=f"{count} rows stored for {conversation}",
    )


async def settled_rows(
    settings: Settings,
    keyspace: str,
    producer: AIOKafkaProducer,
    conversation: str,
    count: int,
) -> list[Any]:
    """The rows once `count` are there and whatever was published before has been
    processed: a sentinel reply goes to every partition of `tokens` after the events
    (Kafka keeps each partition's order), and persist has stored them all."""
    sentinels = f"{conversation}-sentinels"
    partitions = settings.tokens_partitions
    for partition in range(partitions):
        sentinel = final(sentinels, f"sentinel {partition}")
        await producer.send_and_wait(topics.TOKENS, encode(sentinel), partition=partition)
    await wait_rows(settings, keyspace, sentinels, partitions)
    return await wait_rows(settings, keyspace, conversation, count)


StartPersist = Callable[[], Awaitable[PersistProcess]]


@pytest.fixture
async def start_persist(persist_env: dict[str, str], tmp_path: Path) -> AsyncIterator[StartPersist]:
    """Start `tandoor persist` processes; whatever still runs is stopped afterwards."""
    processes: list[PersistProcess] = []

    async def start() -> PersistProcess:
        process = PersistProcess(tmp_path, persist_env)
        processes.append(process)
        process.start()
        await process.wait_ready()
        return process

    yield start
    for process in processes:
        process.terminate()


DeadLetters = Callable[[bytes], Awaitable[ConsumerRecord[bytes, bytes]]]


@pytest.fixture
async def dead_letter(settings: Settings) -> AsyncIterator[DeadLetters]:
    """The dead letter keyed so, among those written from the fixture's start."""
    dead = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap, fetch_max_wait_ms=50)
    await dead.start()
    found: list[ConsumerRecord[bytes, bytes]] = []

    async def keyed(key: bytes) -> ConsumerRecord[bytes, bytes]:
        async def letters() -> list[ConsumerRecord[bytes, bytes]]:
            batch = await dead.getmany(timeout_ms=500)
            found.extend(r for chunk in batch.values() for r in chunk)
            return [r for r in found if r.key == key]

        return (await eventually(letters, bool, what=f"a dead letter keyed {key!r}"))[0]

    try:
        await assign_from_end(dead, topics.DEAD_LETTER)
        yield keyed
    finally:
        await dead.stop()
