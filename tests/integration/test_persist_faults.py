"""`tandoor persist` against real Kafka and Cassandra, given what it cannot store or
read: the rest goes on, the odd ones are dead-lettered with the reason, and deltas are
committed so that a restart replays little."""

from __future__ import annotations

import uuid

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.structs import TopicPartition

from schemas import topics
from schemas.codec import encode
from schemas.events import TokenEvent, now_ms
from tandoor.settings import Settings
from tests.integration.persisting import (
    DeadLetters,
    StartPersist,
    final,
    publish,
    settled_rows,
)
from tests.integration.pipeline import group_committed
from tests.waiting import eventually

pytestmark = pytest.mark.integration


async def test_a_final_that_cannot_be_stored_is_dead_lettered_and_the_rest_go_on(
    settings: Settings,
    keyspace: str,
    producer: AIOKafkaProducer,
    start_persist: StartPersist,
    dead_letter: DeadLetters,
) -> None:
    """A final Cassandra can never take (a date past year 9999) is tried a few times,
    then goes to the dead-letter topic with the reason; replies after it are stored."""
    conversation = f"c-{uuid.uuid4().hex[:8]}"
    poison = final(conversation, "from the far future", prompt_at=10**16)
    poison = poison.model_copy(update={"created_at_ms": 10**16})
    healthy = final(conversation, "an ordinary reply")
    await start_persist()
    await publish(producer, poison, healthy)
    rows = await settled_rows(settings, keyspace, producer, conversation, 1)
    letter = await dead_letter(poison.request_id.encode())
    assert [(r.message_id, r.content) for r in rows] == [(healthy.request_id, "an ordinary reply")]
    assert letter.value == encode(poison)
    assert b"not stored after 3 tries" in dict(letter.headers)["error"]


async def test_a_tombstone_and_an_undecodable_final_do_not_stop_or_lose_replies(
    settings: Settings,
    keyspace: str,
    producer: AIOKafkaProducer,
    start_persist: StartPersist,
    dead_letter: DeadLetters,
) -> None:
    """A record with no value (any client can write one) stopped persistence, on every
    restart; a final of a schema version it cannot read (a newer worker mid-upgrade) was
    skipped and committed: the reply lost without a trace. Now the one is stepped over,
    the other dead-lettered with the reason, and the reply after both is stored."""
    conversation = f"c-{uuid.uuid4().hex[:8]}"
    healthy = final(conversation, "after the odd ones")
    newer = encode(final(conversation, "written by a newer worker")).replace(b'"v":1', b'"v":99')
    key = healthy.request_id.encode()  # one partition: both odd records come first
    await start_persist()
    await producer.send_and_wait(topics.TOKENS, None, key=key)
    await producer.send_and_wait(topics.TOKENS, newer, key=key)
    await publish(producer, healthy)
    rows = await settled_rows(settings, keyspace, producer, conversation, 1)
    letter = await dead_letter(key)
    assert [(r.message_id, r.content) for r in rows] == [(healthy.request_id, "after the odd ones")]
    assert letter.value == newer
    assert b"unknown schema version 99" in dict(letter.headers)["error"]


async def test_deltas_alone_are_committed_so_a_restart_replays_little(
    settings: Settings,
    persist_env: dict[str, str],
    producer: AIOKafkaProducer,
    start_persist: StartPersist,
) -> None:
    """Persistence skips deltas and commits them less often than each fetch, but it
    commits them: a reply still streaming is not replayed from its start."""
    await start_persist()
    request_id = f"req-{uuid.uuid4().hex[:10]}"
    sent = [
        await producer.send_and_wait(
            topics.TOKENS,
            encode(
                TokenEvent(
                    request_id=request_id,
                    attempt=1,
                    seq=seq,
                    delta="word ",
                    token_count=1,
                    created_at_ms=now_ms(),
                )
            ),
            key=request_id.encode(),
        )
        for seq in range(20)
    ]
    tp = TopicPartition(topics.TOKENS, sent[-1].partition)
    end = sent[-1].offset + 1
    group = persist_env["TANDOOR_PERSIST_GROUP"]
    await eventually(
        lambda: group_committed(settings, group, tp),
        lambda offset: offset is not None and offset >= end,
        what="persistence to commit a reply's deltas",
    )
