"""A gateway that dies part-way through a write, against real Cassandra: at every
statement, before it is sent and after it is applied, what a user can see afterwards
is the whole record or nothing (a listed file that cannot be fetched, a conversation
without its message, are the failures), and a delete the user retries leaves nothing
stored. A batch that Kafka takes only part of, or whose gateway dies part-way, runs no line."""

from __future__ import annotations

import datetime as dt
import itertools
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import orjson
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaTimeoutError

from producers.gateway.batches.objects import QUEUING_LIMIT, utc_now
from producers.gateway.batches.records import StoredBatch, StoredFile
from producers.gateway.batches.service import BatchService, CreateBatch
from producers.gateway.batches.store import CHUNK_BYTES, BatchStore, FileStore
from producers.gateway.conversations.protocol import Conversation
from producers.gateway.conversations.rows import from_ms
from producers.gateway.conversations.service import BATCHED_MESSAGE_BYTES, ConversationService
from producers.gateway.errors import ApiError
from schemas import topics
from schemas.topics import BATCH_PARTITIONS
from tandoor.policies.api_keys import Principal
from tandoor.settings import Settings

pytestmark = pytest.mark.integration

MODEL = "smollm2"
USER = "alice"
AT = dt.datetime(2026, 12, 1, 12, 0, 0, 123000)


class Died(RuntimeError):
    """The process wrote nothing more from here on."""


class DyingSession:
    """Passes statements to Cassandra until the process dies at statement `at`: before
    sending it, or once Cassandra has applied it (the answer lost). Nothing later is sent."""

    def __init__(self, session: Any, at: int, applied: bool) -> None:
        self._session = session
        self._at = at
        self._applied = applied
        self.sent = 0

    def __getattr__(self, name: str) -> Any:  # prepare, default_timeout: as the session's
        return getattr(self._session, name)

    def execute_async(self, statement: Any, params: Any = None, **options: Any) -> Any:
        n, self.sent = self.sent, self.sent + 1
        if n > self._at or (n == self._at and not self._applied):
            raise Died(f"died before statement {n}")
        future = self._session.execute_async(statement, params, **options)
        if n == self._at:
            future.result()  # applied on the server; the caller never hears of it
            raise Died(f"died after statement {n}")
        return future


async def every_crash(session: Any, write: Callable[[Any], Awaitable[None]]) -> list[str]:
    """Run `write` once whole (counting its statements), then once per crash point;
    a label for each interrupted run, in order."""
    whole = DyingSession(session, at=10**6, applied=True)
    await write(whole)
    runs = []
    for at, applied in itertools.product(range(whole.sent), (False, True)):
        with pytest.raises(Died):
            await write(DyingSession(session, at, applied))
        runs.append(f"died {'after' if applied else 'before'} statement {at} of {whole.sent}")
    return runs


async def test_an_upload_is_listed_and_fetchable_whole_or_not_at_all(session: Any) -> None:
    content = b"x" * (2 * CHUNK_BYTES + 10)  # three chunks
    files = FileStore(session)
    made: list[str] = []

    async def upload(through: Any) -> None:
        file_id = f"file-{uuid.uuid4().hex}"
        made.append(file_id)
        stored = StoredFile(file_id, USER, "batch", "in.jsonl", len(content), AT)
        await FileStore(through).create(stored, content)

    crashes = await every_crash(session, upload)
    listed = {f.file_id for f in await files.of_user(USER, 1000, "desc", None)}
    assert made[0] in listed  # the whole upload
    for file_id, crash in zip(made[1:], crashes, strict=True):
        stored = await files.get(file_id)
        assert (stored is not None) == (file_id in listed), crash
        if stored is not None:
            assert await files.content(file_id) == content, crash


@pytest.mark.parametrize(
    "question",
    ["what is my balance?", "é" * BATCHED_MESSAGE_BYTES],  # one batch; the message first
)
async def test_an_api_calls_conversation_appears_with_its_message_or_not_at_all(
    session: Any, question: str
) -> None:
    conversations = ConversationService(session, [MODEL])
    made: list[str] = []

    async def store_call(through: Any) -> None:
        conversation = Conversation(
            id=f"c_{uuid.uuid4().hex}", model=MODEL, title="t", created_at=AT, updated_at=AT
        )
        made.append(conversation.id)
        await ConversationService(through, [MODEL]).create_with_message(
            USER, conversation, f"m_{uuid.uuid4().hex}", question
        )

    crashes = await every_crash(session, store_call)
    page = await conversations.page(USER, 100, None)
    listed = {c.id for c in page.data}
    assert made[0] in listed
    for conversation_id, crash in zip(made[1:], crashes, strict=True):
        try:
            opened = await conversations.get(USER, conversation_id)
        except ApiError as exc:
            assert exc.status == 404, crash
            assert conversation_id not in listed, crash
            continue
        assert conversation_id in listed, crash
        assert [m.content for m in opened.messages] == [question], crash


@pytest.mark.parametrize("text", ["and in French?", "é" * BATCHED_MESSAGE_BYTES])
async def test_a_follow_up_message_never_hides_its_conversation(session: Any, text: str) -> None:
    """A sidebar row whose time its conversation does not have is passed over: moving to
    the top half done (the old row gone, the time not yet changed) hid the conversation."""
    conversations = ConversationService(session, [MODEL])
    made: list[tuple[str, dt.datetime]] = []

    async def follow_up(through: Any) -> None:
        opened = await conversations.create(USER, MODEL, "t")
        at_ms = int(opened.updated_at.timestamp() * 1000) + 60_000
        made.append((opened.id, from_ms(at_ms)))
        await ConversationService(through, [MODEL]).add_user_message(
            USER, opened, f"m_{uuid.uuid4().hex}", text, at_ms
        )

    crashes = await every_crash(session, follow_up)
    listed = {c.id: c.updated_at for c in (await conversations.page(USER, 1000, None)).data}
    assert listed[made[0][0]] == made[0][1]  # the whole write moved it to the top
    for (conversation_id, moved_at), crash in zip(made, ["whole", *crashes], strict=True):
        assert conversation_id in listed, crash
        stored = [m.content for m in (await conversations.get(USER, conversation_id)).messages]
        if listed[conversation_id] == moved_at:  # at the top: its message is there
            assert stored == [text], crash


async def test_an_uploaded_batch_is_listed_and_readable_whole_or_not_at_all(session: Any) -> None:
    batches = BatchStore(session)
    made: list[str] = []

    async def create(through: Any) -> None:
        batch_id = f"batch_{uuid.uuid4().hex}"
        made.append(batch_id)
        batch = StoredBatch(
            batch_id, USER, "file-x", "/v1/chat/completions", "24h", 3, None, AT, None
        )
        await BatchStore(through).create(batch)

    crashes = await every_crash(session, create)
    listed = set(await batches.of_user(USER, 1000, None))
    assert made[0] in listed
    for batch_id, crash in zip(made[1:], crashes, strict=True):
        assert (await batches.get(batch_id) is not None) == (batch_id in listed), crash


async def test_a_deleted_conversation_leaves_nothing_stored_once_retried(session: Any) -> None:
    """The user sees the delete fail and deletes again (or finds it gone): its messages
    and sidebar rows are gone with it. Cut short after the conversation's row, the old
    delete left the messages where the retry (a 404) could not reach them."""
    conversations = ConversationService(session, [MODEL])
    made: list[str] = []

    async def delete(through: Any) -> None:
        opened = await conversations.create(USER, MODEL, "t")
        at_ms = int(opened.updated_at.timestamp() * 1000) + 60_000
        await conversations.add_user_message(USER, opened, f"m_{uuid.uuid4().hex}", "hi", at_ms)
        made.append(opened.id)
        await ConversationService(through, [MODEL]).delete(USER, opened.id)

    crashes = await every_crash(session, delete)
    for conversation_id, crash in zip(made, ["whole", *crashes], strict=True):
        try:
            await conversations.delete(USER, conversation_id)  # the user's retry
        except ApiError as exc:
            assert exc.status == 404, crash
        assert rows_of(session, "messages_by_conversation", conversation_id) == 0, crash
        assert conversation_id not in sidebar_ids(session), crash


async def test_a_deleted_file_leaves_no_bytes_stored_once_retried(session: Any) -> None:
    files = FileStore(session)
    content = b"y" * (CHUNK_BYTES + 1)
    made: list[str] = []

    async def delete(through: Any) -> None:
        stored = StoredFile(f"file-{uuid.uuid4().hex}", USER, "batch", "in.jsonl", len(content), AT)
        await files.create(stored, content)
        made.append(stored.file_id)
        await FileStore(through).delete(stored)

    crashes = await every_crash(session, delete)
    for file_id, crash in zip(made, ["whole", *crashes], strict=True):
        stored = await files.get(file_id)
        if stored is not None:  # the user still sees it: deletes it again
            await files.delete(stored)
        assert rows_of(session, "file_chunks", file_id, key="file_id") == 0, crash
        assert file_id not in {f.file_id for f in await files.of_user(USER, 1000, "desc", None)}


def rows_of(session: Any, table: str, value: str, key: str = "conversation_id") -> int:
    return len(list(session.execute(f"SELECT {key} FROM {table} WHERE {key} = %s", (value,))))


def sidebar_ids(session: Any) -> set[str]:
    rows = session.execute(
        "SELECT conversation_id FROM conversations_by_user WHERE user_id = %s", (USER,)
    )
    return {row.conversation_id for row in rows}


class GivingOut(AIOKafkaProducer):  # type: ignore[misc]
    """A producer that takes `takes` records, then fails with `failure`: Kafka timing
    out, or the process dying (then nothing more is sent, not even the abort)."""

    def __init__(self, takes: int, failure: BaseException, **config: Any) -> None:
        super().__init__(**config)
        self._left, self._failure = takes, failure

    async def send(self, *args: Any, **kwargs: Any) -> Any:
        if self._left == 0:
            raise self._failure
        self._left -= 1
        return await super().send(*args, **kwargs)

    async def abort_transaction(self) -> None:
        if isinstance(self._failure, Died):
            raise self._failure  # the broker aborts it once its timeout has passed
        await super().abort_transaction()


def giving_out(
    settings: Settings, failure: BaseException, made: list[str]
) -> Callable[[str], AIOKafkaProducer]:
    def make(transactional_id: str) -> AIOKafkaProducer:
        made.append(transactional_id)
        return GivingOut(
            2,
            failure,
            bootstrap_servers=settings.kafka_bootstrap,
            transactional_id=transactional_id,
            transaction_timeout_ms=5_000,  # a dead sender's partition is held this long
        )

    return make


URL = "/v1/chat/completions"
BATCH_REQUESTS = [TopicPartition(topics.BATCH_REQUESTS, p) for p in range(BATCH_PARTITIONS)]


@asynccontextmanager
async def batch_requests_reader(settings: Settings) -> AsyncIterator[AIOKafkaConsumer]:
    """A committed-only reader of `batch.requests`, as admission is, from its end now
    (earlier tests left records there that no client can parse)."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.kafka_bootstrap, isolation_level="read_committed"
    )
    await consumer.start()
    try:
        consumer.assign(BATCH_REQUESTS)
        await consumer.seek_to_end(*BATCH_REQUESTS)
        for tp in BATCH_REQUESTS:
            await consumer.position(tp)
        yield consumer
    finally:
        await consumer.stop()


async def records_readable(consumer: AIOKafkaConsumer, key: str) -> int:
    """Records with this key from the reader's position to the end it can read."""
    ends = await consumer.end_offsets(BATCH_REQUESTS)  # committed-only: the stable end
    found = 0
    for tp in BATCH_REQUESTS:
        while await consumer.position(tp) < ends[tp]:
            batch = await consumer.getmany(tp, timeout_ms=1_000)
            found += sum(r.key == key.encode() for r in batch.get(tp, []))
    return found


@pytest.mark.parametrize("failure", [KafkaTimeoutError(), Died("the gateway died")])
async def test_a_batch_kafka_takes_only_part_of_runs_no_line(
    session: Any, settings: Settings, unique: str, failure: BaseException
) -> None:
    """Kafka failing part-way: the client is told to retry and nothing was kept. The
    gateway dying part-way (the SDK retries on its own): no line that got out runs.
    Before, the lines that got out were read by admission and ran, beside the whole
    batch the retry sent (the dead gateway's batch also stayed listed)."""
    caller = Principal(f"u-{unique}", "batch", "k")
    lines = b"".join(
        orjson.dumps(
            {"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions", "body": {}}
        )
        + b"\n"
        for i in range(5)
    )
    made: list[str] = []
    service = BatchService(session, giving_out(settings, failure, made), redis=None)
    uploaded = await service.upload(caller, "in.jsonl", "batch", lines)
    body = CreateBatch(
        input_file_id=uploaded["id"], endpoint="/v1/chat/completions", completion_window="24h"
    )
    async with batch_requests_reader(settings) as reader:
        with pytest.raises((ApiError, Died)) as refused:
            await service.create(caller, "tdr_key", body)
        (transactional_id,) = made
        assert await records_readable(reader, transactional_id.removeprefix("batch-")) == 0
    listed = await service.batches.of_user(caller.user_id, 10, None)
    if isinstance(failure, KafkaTimeoutError):
        assert isinstance(refused.value, ApiError) and refused.value.status == 503
        assert listed == [], "listed, a batch no line of which can run"


async def test_a_batch_whose_gateway_died_while_queuing_it_shows_failed(
    session: Any, settings: Settings, unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its lines never run (the transaction is aborted), but it stayed listed as
    `in_progress` with nothing answered for 24 hours, then `expired` with every line
    `batch_expired`. It shows `validating` while the lines may still be committed,
    then `failed`, saying why."""
    caller = Principal(f"u-{unique}", "batch", "k")
    lines = b"".join(
        orjson.dumps({"custom_id": f"l{i}", "method": "POST", "url": URL, "body": {}}) + b"\n"
        for i in range(3)  # it dies at the third
    )
    service = BatchService(session, giving_out(settings, Died("the gateway died"), []), None)
    uploaded = await service.upload(caller, "in.jsonl", "batch", lines)
    body = CreateBatch(
        input_file_id=uploaded["id"], endpoint="/v1/chat/completions", completion_window="24h"
    )
    with pytest.raises(Died):
        await service.create(caller, "tdr_key", body)
    (batch_id,) = await service.batches.of_user(caller.user_id, 10, None)
    assert (await service.retrieve(caller, batch_id))["status"] == "validating"
    later = utc_now() + QUEUING_LIMIT + dt.timedelta(seconds=1)
    monkeypatch.setattr("producers.gateway.batches.objects.utc_now", lambda: later)
    shown = await service.retrieve(caller, batch_id)
    assert shown["status"] == "failed" and shown["failed_at"] is not None
    assert shown["errors"]["data"][0]["code"] == "queuing_interrupted"
    listed = await service.list(caller, 10, None)
    assert [b["status"] for b in listed["data"]] == ["failed"]
