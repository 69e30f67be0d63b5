"""`tandoor persist` against real Kafka and Cassandra: replies stored once, in place,
whatever the replays, attempts and crashes."""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import ConsumerRecord, TopicPartition

from consumers.history import HistoryWriter, reply_time_ms
from infra.roles import PersistProcess
from infra.topics import start_group_at_end
from producers.gateway.conversations.service import ConversationService
from producers.gateway.errors import ApiError
from schemas import topics
from schemas.codec import encode
from schemas.events import (
    FinalEvent,
    FinishReason,
    MessageKey,
    PromptKind,
    TokenEvent,
    Usage,
    now_ms,
)
from tandoor.clients import assign_from_end, cassandra_session, kafka_producer
from tandoor.settings import Settings
from tests.integration.pipeline import group_committed
from tests.waiting import eventually

pytestmark = pytest.mark.integration


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


@pytest.fixture
async def producer(kafka: str, settings: Settings) -> AsyncIterator[AIOKafkaProducer]:
    async with kafka_producer(settings, client_id="persist-tests") as p:
        yield p


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


async def test_replies_are_stored_once_with_their_status_and_usage(
    settings: Settings, keyspace: str, producer: AIOKafkaProducer, start_persist: StartPersist
) -> None:
    conversation = f"c-{uuid.uuid4().hex[:8]}"
    done = final(conversation, "The capital of France is Paris.")
    stopped = final(conversation, "Once upon a", reason="cancelled")
    private = final(conversation, "Write to ada@example.com or call +44 20 7946 0958.")
    title = final(conversation, "Paris facts", kind="title")  # the service's own job
    process = await start_persist()
    await publish(producer, title, done, stopped, private, done)  # replaying `done`: no change
    rows = await settled_rows(settings, keyspace, producer, conversation, 3)
    assert process.terminate() == 0  # SIGTERM: a clean exit
    by_id = {row.message_id: row for row in rows}
    assert len(rows) == 3
    # Stored as it streamed: through the output moderation.
    assert by_id[private.request_id].content == "Write to [email] or call [phone]."
    assert (by_id[done.request_id].content, by_id[done.request_id].status) == (
        done.text,
        "complete",
    )
    assert (by_id[stopped.request_id].content, by_id[stopped.request_id].status) == (
        "Once upon a",
        "stopped",
    )
    # Right after its prompt, so it sorts after the user message stored at prompt time.
    assert done.prompt_created_at_ms is not None
    epoch = dt.datetime(1970, 1, 1)
    expected = epoch + dt.timedelta(milliseconds=done.prompt_created_at_ms + 1)
    assert by_id[done.request_id].created_at == expected
    with cassandra_session(settings, keyspace) as session:
        usage = list(
            session.execute(
                "SELECT request_id, prompt_tokens, completion_tokens FROM usage_by_user_day "
                "WHERE user_id = 'alice' AND day = %s",
                (by_id[done.request_id].created_at.date(),),
            )
        )
        touched = session.execute(
            "SELECT last_reply_at FROM conversations WHERE conversation_id = %s", (conversation,)
        ).one()
    assert {(u.request_id, u.completion_tokens) for u in usage} >= {
        (done.request_id, 6),
        (stopped.request_id, 3),
    }
    # A title or summary the service asked for is not the user's: "Your usage" showed
    # two requests for one message (and never matched the quota's count).
    assert title.request_id not in {u.request_id for u in usage}
    assert touched is not None and touched.last_reply_at is not None


async def test_the_highest_attempt_wins_in_any_order(
    settings: Settings, keyspace: str, producer: AIOKafkaProducer, start_persist: StartPersist
) -> None:
    conversation = f"c-{uuid.uuid4().hex[:8]}"
    prompt_at = now_ms() - 5000
    second = final(conversation, "second attempt", attempt=2, request_id="r-x", prompt_at=prompt_at)
    late_first = final(
        conversation, "first attempt", attempt=1, request_id="r-x", prompt_at=prompt_at
    )
    await start_persist()
    await publish(producer, second, late_first)
    rows = await settled_rows(settings, keyspace, producer, conversation, 1)
    assert [(r.message_id, r.content, r.attempt) for r in rows] == [("r-x", "second attempt", 2)]


async def test_two_different_finals_of_one_attempt_are_never_stored_mixed(
    settings: Settings, keyspace: str, producer: AIOKafkaProducer, start_persist: StartPersist
) -> None:
    """Redis down through a rebalance: two workers ran one request as attempt 1 without
    leases. Written with one timestamp, Cassandra kept the greater value of each cell:
    one final's text with the other's token count and finish reason."""
    conversation = f"c-{uuid.uuid4().hex[:8]}"
    prompt_at = now_ms() - 5000
    one = final(conversation, "zz", request_id="r-y", prompt_at=prompt_at)  # 1 token
    other = final(
        conversation, "aa bb cc", request_id="r-y", prompt_at=prompt_at, reason="cancelled"
    )
    await start_persist()
    await publish(producer, one, other)
    rows = await settled_rows(settings, keyspace, producer, conversation, 1)
    stored = [(r.content, r.completion_tokens, r.finish_reason) for r in rows]
    assert stored in ([("zz", 1, "stop")], [("aa bb cc", 3, "cancelled")]), stored


async def test_kill_9_and_restart_loses_and_duplicates_nothing(
    settings: Settings, keyspace: str, producer: AIOKafkaProducer, start_persist: StartPersist
) -> None:
    conversation = f"c-{uuid.uuid4().hex[:8]}"
    replies = [final(conversation, f"reply number {i}") for i in range(120)]
    process = await start_persist()
    await publish(producer, *replies[:60])
    await wait_rows(settings, keyspace, conversation, 20)
    process.kill()  # mid-stream: some stored, maybe some stored but not committed
    await publish(producer, *replies[60:])
    await start_persist()
    rows = await settled_rows(settings, keyspace, producer, conversation, 120)
    assert sorted(r.message_id for r in rows) == sorted(r.request_id for r in replies)
    assert {r.message_id: r.content for r in rows} == {r.request_id: r.text for r in replies}


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


async def test_a_reply_finished_after_its_conversation_was_deleted_is_not_kept(
    session: Any,
) -> None:
    """Deleted while the reply still runs: the reply's writes carry its prompt's time,
    older than the delete, so Cassandra keeps them shadowed and nothing of the chat
    comes back (opening it is a 404, its partition holds no row)."""
    conversations = ConversationService(session, ["smollm2"])
    opened = await conversations.create("alice", "smollm2", "t")
    prompt_at = now_ms() - 1000
    request_id = f"req-{uuid.uuid4().hex[:10]}"
    await conversations.add_user_message("alice", opened, request_id, "hi", prompt_at)
    await conversations.delete("alice", opened.id)

    reply = final(opened.id, "the reply", request_id=request_id, prompt_at=prompt_at)
    await HistoryWriter(session).store(reply)

    stored = session.execute(
        "SELECT message_id FROM messages_by_conversation WHERE conversation_id = %s",
        (opened.id,),
    )
    assert list(stored) == []
    row = session.execute("SELECT * FROM conversations WHERE conversation_id = %s", (opened.id,))
    assert list(row) == [], "the row came back, holding only last_reply_at"
    with pytest.raises(ApiError) as gone:
        await conversations.get("alice", opened.id)
    assert gone.value.status == 404


async def test_a_final_hides_what_its_prompt_replaced_even_what_is_stored_after_it(
    settings: Settings, keyspace: str, producer: AIOKafkaProducer, start_persist: StartPersist
) -> None:
    """A regenerate whose gateway died right after queueing it never marked the old
    replies replaced (both were shown). The new reply's final carries what it replaces,
    and persistence hides those as it stores it: one stored before it, and one whose own
    final comes after (a reply still on its way), which stays hidden."""
    conversation = f"c-{uuid.uuid4().hex[:8]}"
    stored = final(conversation, "the first answer", prompt_at=now_ms() - 9000)
    late = final(conversation, "an answer on its way", prompt_at=now_ms() - 6000)
    keys = [
        MessageKey(created_at_ms=reply_time_ms(old), message_id=old.request_id)
        for old in (stored, late)
    ]
    new = final(conversation, "the regenerated answer").model_copy(update={"replaces": keys})
    await start_persist()
    await publish(producer, stored)
    await wait_rows(settings, keyspace, conversation, 1)
    await publish(producer, new, late)
    rows = await settled_rows(settings, keyspace, producer, conversation, 3)
    assert {r.message_id: (r.content, r.status) for r in rows} == {
        stored.request_id: ("the first answer", "replaced"),
        late.request_id: ("an answer on its way", "replaced"),
        new.request_id: ("the regenerated answer", "complete"),
    }


async def test_a_replayed_batch_answer_keeps_its_write_time(
    settings: Settings, keyspace: str, producer: AIOKafkaProducer, start_persist: StartPersist
) -> None:
    """A batch's completed_at is its last answer's write time: a final read again (a
    persistence consumer restarted before its commit) must not move it."""
    conversation = f"c-{uuid.uuid4().hex[:8]}"
    batch_id = f"batch-{uuid.uuid4().hex[:8]}"
    answer = final(conversation, "42").model_copy(
        update={"kind": "batch", "batch_id": batch_id, "custom_id": "line-1"}
    )
    await start_persist()

    def written() -> list[Any]:
        query = (
            "SELECT WRITETIME(output) AS at FROM batch_outputs "
            "WHERE user_id = 'alice' AND batch_id = %s"
        )
        return select_rows(settings, keyspace, query, (batch_id,))

    await publish(producer, answer)
    first = await eventually(lambda: asyncio.to_thread(written), bool, what="the answer stored")
    await publish(producer, answer)  # the replay: through Kafka, so later by milliseconds
    await settled_rows(settings, keyspace, producer, f"{conversation}-flush", 0)
    assert [r.at for r in await asyncio.to_thread(written)] == [first[0].at]
