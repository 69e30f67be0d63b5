"""Listing a user's files and batches against real Cassandra: every one once, in order,
however the pages fall, ones sharing a millisecond included. A batch's counts are kept
on its row once they are final, and not before; counts that could not be kept are
counted again. Metadata reads back as given."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import hashlib
import tracemalloc
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis
from cassandra import OperationTimedOut
from cassandra.cluster import NoHostAvailable

from consumers.history import INSERT_BATCH_OUTPUT, batch_output_row
from infra.process import free_port
from producers.gateway.batches.records import StoredBatch, StoredFile
from producers.gateway.batches.service import BatchService
from producers.gateway.batches.store import (
    CHUNK_BYTES,
    OUTPUT_LINES_A_PAGE,
    BatchStore,
    FileStore,
    Order,
)
from producers.gateway.errors import ApiError
from tandoor.clients import cql
from tandoor.policies.api_keys import Principal
from tandoor.policies.redis_keys import batch_cancel_key

NO_KAFKA: Any = None  # reads and stores only: no batch is queued

pytestmark = pytest.mark.integration

AT = dt.datetime(2026, 12, 1, 12, 0, 0, 123000)


def stored(file_id: str, at: dt.datetime, user: str = "alice") -> StoredFile:
    return StoredFile(file_id, user, "batch", f"{file_id}.jsonl", 10, at)


async def every_page(files: FileStore, order: Order, limit: int) -> list[str]:
    seen: list[str] = []
    after: StoredFile | None = None
    while page := await files.of_user("alice", limit, order, after):
        seen += [f.file_id for f in page]
        after = page[-1]
    return seen


@pytest.mark.parametrize("limit", [1, 2, 3, 10])
async def test_pages_list_every_file_once_in_order(session: Any, limit: int) -> None:
    files = FileStore(session)
    earlier, later = AT - dt.timedelta(seconds=1), AT + dt.timedelta(seconds=1)
    uploads = [stored("f-early", earlier), *(stored(f"f-same-{i}", AT) for i in range(4))]
    uploads += [stored("f-late", later), stored("f-bob", AT, user="bob")]
    for upload in uploads:
        await files.create(upload, b"{}\n")
    same_ms = [f"f-same-{i}" for i in range(4)]  # within a millisecond: by id
    assert await every_page(files, "desc", limit) == ["f-late", *same_ms, "f-early"]
    assert await every_page(files, "asc", limit) == ["f-early", *same_ms[::-1], "f-late"]
    await files.delete(uploads[2])
    assert "f-same-1" not in await every_page(files, "desc", limit)
    assert await files.get("f-same-1") is None


@pytest.mark.parametrize("limit", [1, 2, 3, 10])
async def test_batch_pages_list_every_batch_once_newest_first(session: Any, limit: int) -> None:
    batches = BatchStore(session)

    def batch(batch_id: str, at: dt.datetime, user: str = "alice") -> StoredBatch:
        return StoredBatch(batch_id, user, "f", "/v1/chat/completions", "24h", 1, None, at, None)

    earlier, later = AT - dt.timedelta(seconds=1), AT + dt.timedelta(seconds=1)
    made = [batch("b-early", earlier), *(batch(f"b-same-{i}", AT) for i in range(4))]
    made += [batch("b-late", later), batch("b-bob", AT, user="bob")]
    for each in made:
        await batches.create(each)
    by_id = {b.batch_id: b for b in made}
    seen: list[str] = []
    while page := await batches.of_user("alice", limit, by_id[seen[-1]] if seen else None):
        seen += page
    same_ms = [f"b-same-{i}" for i in range(4)]  # within a millisecond: by id
    assert seen == ["b-late", *same_ms, "b-early"]


async def test_a_listed_batch_whose_row_is_gone_leaves_the_page_whole(session: Any) -> None:
    """Listed but withdrawn meanwhile (a create whose Kafka send failed), or a write
    seen half: the whole page was a 404, which the SDK does not retry."""
    user = f"u-{uuid.uuid4().hex[:8]}"
    service = BatchService(session, make_producer=NO_KAFKA, redis=None)
    made = [
        StoredBatch(f"b-{i}-{user}", user, "f", "/v1/chat/completions", "24h", 1, None, AT, None)
        for i in range(3)
    ]
    for batch in made:
        await service.batches.create(batch)
    await cql(session, "DELETE FROM api_batches WHERE batch_id = %s", (made[1].batch_id,))
    listed = await service.list(Principal(user, "plus", "k"), limit=10, after=None)
    assert sorted(b["id"] for b in listed["data"]) == [made[0].batch_id, made[2].batch_id]


async def test_a_cancel_redis_missed_says_it_is_stored_and_takes_effect_when_retried(
    session: Any, redis: aioredis.Redis
) -> None:
    """Stored, then not told to admission (Redis unreachable): the 503 said "nothing was
    changed" while the batch showed `cancelling` and every line ran on."""
    user = f"u-{uuid.uuid4().hex[:8]}"
    caller = Principal(user, "batch", "k")
    now = dt.datetime.now(dt.UTC).replace(tzinfo=None)  # within its window: cancellable
    made = StoredBatch(f"b-{user}", user, "f", "/v1/chat/completions", "24h", 1, None, now, None)
    unreachable = aioredis.Redis(port=free_port(), socket_connect_timeout=1)
    await BatchService(session, make_producer=NO_KAFKA, redis=unreachable).batches.create(made)
    with pytest.raises(ApiError) as refused:
        await BatchService(session, NO_KAFKA, redis=unreachable).cancel(caller, made.batch_id)
    assert refused.value.status == 503 and "nothing was changed" not in refused.value.message
    assert "retried" in refused.value.message
    await unreachable.aclose()
    service = BatchService(session, make_producer=NO_KAFKA, redis=redis)
    assert (await service.retrieve(caller, made.batch_id))["status"] == "cancelling"
    assert (await service.cancel(caller, made.batch_id))["status"] == "cancelling"
    assert await redis.exists(batch_cancel_key(user, made.batch_id))  # admission is told


ANSWERED_MS = 1_780_000_000_000


def answer(session: Any, batch: StoredBatch, custom_id: str, status: int) -> None:
    """An output row as the persistence consumer writes it."""
    output = {"custom_id": custom_id, "response": {"status_code": status, "body": {}}}
    row = batch_output_row(
        batch.user_id, batch.batch_id, output, 1_796_000_000_000_000, ANSWERED_MS
    )
    session.execute(session.prepare(INSERT_BATCH_OUTPUT), row)


async def test_a_batchs_counts_are_kept_once_final_and_read_from_its_row(session: Any) -> None:
    service = BatchService(session, make_producer=NO_KAFKA, redis=None)
    caller = Principal("carol", "batch", "k")
    made = StoredBatch("b-counts", "carol", "f", "/v1/chat/completions", "24h", 3, None, AT, None)
    made = dataclasses.replace(made, created_at=dt.datetime.now(dt.UTC).replace(tzinfo=None))
    await service.batches.create(made)
    answer(session, made, "a", 200)
    answer(session, made, "b", 400)
    shown = await service.retrieve(caller, "b-counts")
    assert shown["status"] == "in_progress"
    assert (await service.batches.get("b-counts")).settled is None  # type: ignore[union-attr]
    answer(session, made, "c", 200)
    finished = await service.retrieve(caller, "b-counts")
    assert finished["status"] == "completed"
    assert finished["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    # When its last line was answered, not its output's write time (a rank now).
    assert finished["completed_at"] == ANSWERED_MS // 1000
    stored = await service.batches.get("b-counts")
    assert stored is not None and stored.settled is not None
    # Read from the row now: an output row that could not come any more is not counted.
    answer(session, made, "d", 200)
    assert await service.retrieve(caller, "b-counts") == finished
    assert (await service.list(caller, limit=5, after=None))["data"] == [finished]


@pytest.mark.parametrize("metadata", [None, {}, {"team": "a", "empty": ""}])
async def test_a_batchs_metadata_reads_back_as_it_was_given(
    session: Any, metadata: dict[str, str] | None
) -> None:
    """Cassandra keeps an empty map as no value: `{}` still reads back as `{}`."""
    batches = BatchStore(session)
    batch_id = f"b-meta-{uuid.uuid4().hex}"
    made = StoredBatch(batch_id, "erin", "f", "/v1/chat/completions", "24h", 1, metadata, AT, None)
    await batches.create(made)
    found = await batches.get(batch_id)
    assert found is not None and found.metadata == metadata
    assert (found.metadata is None) == (metadata is None)


class SettleTimesOut:
    """Cassandra as seen by a gateway whose write of a batch's counts times out."""

    def __init__(self, session: Any) -> None:
        self._session = session

    def execute_async(self, statement: Any, params: Any = None) -> Any:
        if "SET settled_" in str(statement):
            raise OperationTimedOut("the write of the counts timed out")
        return self._session.execute_async(statement, params)


async def test_counts_that_could_not_be_kept_are_counted_again(session: Any) -> None:
    """The answer is the same whether the counts were kept or not, and the next read
    keeps them."""
    caller = Principal("dave", "batch", "k")
    made = StoredBatch("b-unkept", "dave", "f", "/v1/chat/completions", "24h", 2, None, AT, None)
    made = dataclasses.replace(made, created_at=dt.datetime.now(dt.UTC).replace(tzinfo=None))
    service = BatchService(session, make_producer=NO_KAFKA, redis=None)
    await service.batches.create(made)
    answer(session, made, "a", 200)
    answer(session, made, "b", 500)
    unkept = await BatchService(
        SettleTimesOut(session), make_producer=NO_KAFKA, redis=None
    ).retrieve(caller, "b-unkept")
    assert unkept["status"] == "completed"
    assert unkept["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
    assert (await service.batches.get("b-unkept")).settled is None  # type: ignore[union-attr]
    assert await service.retrieve(caller, "b-unkept") == unkept
    assert (await service.batches.get("b-unkept")).settled is not None  # type: ignore[union-attr]


async def test_deleting_each_file_as_it_is_listed_deletes_them_all(session: Any) -> None:
    """OpenAI's usual clean-up: the next page starts after a file just deleted, which
    was a 404 on page 2."""
    service = BatchService(session, make_producer=NO_KAFKA, redis=None)
    caller = Principal(f"dave-{uuid.uuid4().hex[:6]}", "batch", "k")
    uploaded = [
        (await service.upload(caller, f"{i}.jsonl", "batch", b"{}\n"))["id"] for i in range(5)
    ]
    deleted, after = [], None
    while True:
        page = await service.list_files(caller, limit=2, order="desc", after=after, purpose=None)
        for listed in page["data"]:
            deleted.append((await service.delete_file(caller, listed["id"]))["id"])
        if not page["has_more"]:
            break
        after = page["data"][-1]["id"]
    assert sorted(deleted) == sorted(uploaded)
    assert (await service.list_files(caller, 10, "desc", None, None))["data"] == []
    # A cursor naming no time is still unknown, and one past the year 9999 (a 500).
    for cursor in (f"file-{uuid.uuid4().hex}", "file-t" + "f" * 12 + "0" * 20):
        with pytest.raises(ApiError) as gone:
            await service.list_files(caller, 2, "desc", cursor, None)
        assert gone.value.status == 404 and cursor in gone.value.message


async def pieces(content: bytes, size: int) -> AsyncIterator[bytes]:
    for i in range(0, len(content), size):
        yield content[i : i + size]


async def test_a_file_goes_in_and_comes_out_a_chunk_at_a_time(session: Any) -> None:
    """Held whole, twice on the way in and once on the way out: a few 64 MiB uploads or
    downloads at once ran a replica out of memory."""
    service = BatchService(session, make_producer=NO_KAFKA, redis=None)
    caller = Principal(f"u-{uuid.uuid4().hex[:8]}", "batch", "k")
    content = bytes(range(256)) * (48 * CHUNK_BYTES // 256) + b"tail"  # 24 MiB and a bit
    digest, longest = hashlib.sha256(), 0
    tracemalloc.start()
    try:
        uploaded = await service.upload(caller, "in.jsonl", "batch", pieces(content, 64 * 1024))
        _, upload_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        chunks, size = await service.content(caller, uploaded["id"])
        async for chunk in chunks:
            digest.update(chunk)
            longest = max(longest, len(chunk))
        _, download_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert uploaded["bytes"] == size == len(content)  # its Content-Length
    assert digest.digest() == hashlib.sha256(content).digest()
    assert longest == CHUNK_BYTES
    # A few chunks at a time (the driver's own copies included), not the file.
    assert upload_peak < 12 * CHUNK_BYTES, upload_peak
    assert download_peak < 12 * CHUNK_BYTES, download_peak


async def test_uploads_beyond_what_one_user_may_keep_are_refused(session: Any) -> None:
    caller = Principal(f"u-{uuid.uuid4().hex[:8]}", "batch", "k")
    service = BatchService(session, make_producer=NO_KAFKA, redis=None, max_user_bytes=100)
    kept = await service.upload(caller, "a.jsonl", "batch", b"x" * 60)
    with pytest.raises(ApiError) as refused:  # 120 in all
        await service.upload(caller, "b.jsonl", "batch", pieces(b"x" * 60, 7), size=60)
    assert refused.value.status == 413 and "delete some" in refused.value.message
    await service.upload(caller, "c.jsonl", "batch", b"x" * 40)  # 100: just fits
    await service.delete_file(caller, kept["id"])
    await service.upload(caller, "d.jsonl", "batch", b"x" * 60)  # room again
    other = Principal(f"u-{uuid.uuid4().hex[:8]}", "batch", "k")
    await service.upload(other, "e.jsonl", "batch", b"x" * 100)  # each user's own


async def test_an_empty_file_and_files_past_the_count_a_user_may_keep_are_refused(
    session: Any,
) -> None:
    """Nothing refused them: each empty upload was one more row, all of them read at
    every upload to sum what the user holds, without end."""
    caller = Principal(f"u-{uuid.uuid4().hex[:8]}", "batch", "k")
    service = BatchService(session, make_producer=NO_KAFKA, redis=None, max_user_files=2)
    for empty in (b"", pieces(b"", 7)):
        with pytest.raises(ApiError) as refused:
            await service.upload(caller, "empty.jsonl", "batch", empty, size=0)
        assert (refused.value.status, refused.value.param) == (400, "file")
        assert "empty" in refused.value.message
    kept = [await service.upload(caller, f"{n}.jsonl", "batch", b"x\n") for n in range(2)]
    with pytest.raises(ApiError) as refused:
        await service.upload(caller, "third.jsonl", "batch", b"x\n")
    assert refused.value.status == 409 and "delete some" in refused.value.message
    # Or the SDK sent the whole file twice more before giving up.
    assert refused.value.headers == {"x-should-retry": "false"}
    await service.delete_file(caller, kept[0]["id"])
    await service.upload(caller, "third.jsonl", "batch", b"x\n")  # room again
    listed = await service.list_files(caller, 100, "asc", None, None)
    assert [f["filename"] for f in listed["data"]] == ["1.jsonl", "third.jsonl"]


async def test_a_batchs_output_file_is_read_a_page_of_lines_at_a_time(session: Any) -> None:
    """Each line holds a whole reply: read in the driver's pages of 5,000 lines, one
    download of a long batch held ~100 MB, a few at once ran a replica out of memory."""
    store = BatchStore(session)
    user = f"u-{uuid.uuid4().hex[:8]}"
    made = StoredBatch("b-pages", user, "f", "/v1/chat/completions", "24h", 250, None, AT, None)
    names = [f"line-{n:03}" for n in range(250)]
    for n, name in enumerate(names):
        answer(session, made, name, 200 if n % 5 else 400)
    read = [chunk async for chunk in store.output_lines(user, "b-pages", succeeded=True)]
    lines = [line for chunk in read for line in chunk.splitlines()]
    assert [orjson.loads(line)["custom_id"] for line in lines] == [
        name for n, name in enumerate(names) if n % 5
    ], "every succeeded line once, in custom_id order"
    assert max(chunk.count(b"\n") for chunk in read) <= OUTPUT_LINES_A_PAGE


async def stored_chunks(session: Any, file_id: str) -> int:
    rows = await cql(session, "SELECT chunk FROM file_chunks WHERE file_id = %s", (file_id,))
    return len(rows)


async def test_an_upload_cut_short_leaves_none_of_its_chunks_stored(session: Any) -> None:
    """Chunks are written as they are read; an upload that fails or is cancelled half-way
    left them stored for ever, counted against no one."""
    files = FileStore(session)
    two_chunks_in, go_on = asyncio.Event(), asyncio.Event()

    async def cut(after: int, how: str) -> AsyncIterator[bytes]:
        yield b"x" * (after * CHUNK_BYTES)
        two_chunks_in.set()
        if how == "fails":
            raise OSError("the spooled upload could not be read")
        await go_on.wait()
        yield b"never"

    failed = stored(f"f-{uuid.uuid4().hex[:8]}", AT)
    with pytest.raises(OSError):
        await files.create(failed, cut(2, "fails"))
    assert await stored_chunks(session, failed.file_id) == 0

    two_chunks_in.clear()
    cancelled = stored(f"f-{uuid.uuid4().hex[:8]}", AT)
    upload = asyncio.create_task(files.create(cancelled, cut(2, "waits")))
    await two_chunks_in.wait()
    assert await stored_chunks(session, cancelled.file_id) == 2  # written as read
    upload.cancel()
    with pytest.raises(asyncio.CancelledError):
        await upload
    assert await stored_chunks(session, cancelled.file_id) == 0
    assert await files.get(cancelled.file_id) is None


async def test_an_upload_whose_file_rows_are_refused_leaves_none_of_its_chunks(
    session: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cassandra refusing the rows that make the file visible (no replica up) left every
    chunk stored with nothing pointing at it."""

    async def refused(*_: Any) -> None:
        raise NoHostAvailable("no host for the file's rows", {})

    monkeypatch.setattr("producers.gateway.batches.store.cql_together", refused)
    upload = stored(f"f-{uuid.uuid4().hex[:8]}", AT)
    with pytest.raises(NoHostAvailable):
        await FileStore(session).create(upload, b"x" * (2 * CHUNK_BYTES))
    assert await stored_chunks(session, upload.file_id) == 0


async def test_a_batchs_output_file_object_is_the_same_on_every_read(
    session: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its `created_at` was the time of each call, so the same file seemed made anew on
    every read; it is the batch's, and `bytes` is the file's."""
    user = f"u-{uuid.uuid4().hex[:8]}"
    made = StoredBatch(f"b-{user}", user, "f", "/v1/chat/completions", "24h", 2, None, AT, None)
    service = BatchService(session, make_producer=NO_KAFKA, redis=None)
    await service.batches.create(made)
    for name in ("a", "b"):
        answer(session, made, name, 200)
    later = dt.datetime.now(dt.UTC) + dt.timedelta(days=1)  # the clock at the read
    monkeypatch.setattr("producers.gateway.batches.service.utc_now", lambda: later)
    shown = await service.file(Principal(user, "batch", "k"), f"file-out-{made.batch_id}")
    assert shown["created_at"] == int(AT.replace(tzinfo=dt.UTC).timestamp())
    lines = [c async for c in service.batches.output_lines(user, made.batch_id, True)]
    assert shown["bytes"] == len(b"".join(lines))
