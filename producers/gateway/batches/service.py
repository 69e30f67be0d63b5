"""Files and batches as OpenAI's API shows them, built on `batch.requests`: creating a
batch checks its input file's lines and writes them to the topic with the caller's
key, exactly as any Kafka client may; admission checks, charges and runs each line, and
the outputs stored per line (`batch_outputs`) make the batch's progress and its output
and error files."""

from __future__ import annotations

import asyncio
import codecs
import dataclasses
import datetime as dt
import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Annotated, Any, Literal

import orjson
import re2
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from pydantic import BaseModel, ConfigDict, Field

from producers.batch_topic import send_lines
from producers.gateway.batches.store import (
    Answered,
    BatchStore,
    FileStore,
    Order,
    StoredBatch,
    StoredFile,
)
from producers.gateway.errors import ApiError, not_found, unavailable
from schemas.batch import MAX_CUSTOM_ID_CHARS, MAX_LINE_BYTES
from tandoor.clients import CASSANDRA_DOWN, REDIS_DOWN
from tandoor.policies.api_keys import Principal
from tandoor.policies.redis_keys import BATCH_LINE_TTL_S, batch_cancel_key

log = logging.getLogger(__name__)

MAX_LINES = 50_000
COMPLETION_WINDOW = dt.timedelta(hours=24)
PARAM = "input_file_id"  # what a bad input file is reported against
NOT_BLANK = re2.compile(rb"[^\S\r\n]*\S[^\r\n]*")  # a line with more than white space
OUTPUT_PREFIX, ERROR_PREFIX = "file-out-", "file-err-"  # a batch's files, made when read
EPOCH = dt.datetime(1970, 1, 1)  # naive UTC, as the stored times are


# OpenAI's limits: 16 pairs, keys up to 64 characters, values up to 512.
MetadataKey = Annotated[str, Field(max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=200)
    endpoint: Literal["/v1/chat/completions"]
    completion_window: Literal["24h"]
    metadata: dict[MetadataKey, MetadataValue] | None = Field(default=None, max_length=16)


class BatchService:
    def __init__(self, session: Any, producer: AIOKafkaProducer, redis: Any) -> None:
        self.files = FileStore(session)
        self.batches = BatchStore(session)
        self._producer = producer
        self._redis = redis

    # Files.

    async def upload(
        self, caller: Principal, filename: str, purpose: str, data: bytes
    ) -> dict[str, Any]:
        if purpose != "batch":
            raise ApiError(400, "only purpose 'batch' is supported", param="purpose")
        if not _is_unicode(filename):  # a multipart charset may decode to half a pair
            raise ApiError(400, "the file's name is not valid Unicode text", param="file")
        created = _now()
        stored = StoredFile(
            _file_id(created), caller.user_id, purpose, filename[:256], len(data), created
        )
        await self.files.create(stored, data)
        return _file_object(stored)

    async def file(self, caller: Principal, file_id: str) -> dict[str, Any]:
        if file_id.startswith((OUTPUT_PREFIX, ERROR_PREFIX)):
            batch, chunks = await self._batch_file(caller, file_id)
            size = sum([len(chunk) async for chunk in chunks])
            kind = "output" if file_id.startswith(OUTPUT_PREFIX) else "error"
            name = f"{batch.batch_id}_{kind}.jsonl"
            made = StoredFile(file_id, caller.user_id, "batch_output", name, size, _now())
            return _file_object(made)
        return _file_object(await self._own_file(caller, file_id))

    async def content(self, caller: Principal, file_id: str) -> bytes | AsyncIterator[bytes]:
        """An uploaded file whole; a batch's output or error file as it is read."""
        if file_id.startswith((OUTPUT_PREFIX, ERROR_PREFIX)):
            return (await self._batch_file(caller, file_id))[1]
        await self._own_file(caller, file_id)
        return await self.files.content(file_id)

    async def delete_file(self, caller: Principal, file_id: str) -> dict[str, Any]:
        await self.files.delete(await self._own_file(caller, file_id))
        return {"id": file_id, "object": "file", "deleted": True}

    async def list_files(
        self, caller: Principal, limit: int, order: Order, after: str | None, purpose: str | None
    ) -> dict[str, Any]:
        """The caller's uploads (a batch's output and error files are reached from it)."""
        if purpose not in (None, "batch"):  # the only purpose an upload may have here
            return _page([], has_more=False)
        since = await self._file_cursor(caller, after) if after else None
        found = await self.files.of_user(caller.user_id, limit + 1, order, since)
        return _page([_file_object(f) for f in found[:limit]], has_more=len(found) > limit)

    # Batches.

    async def create(self, caller: Principal, api_key: str, body: CreateBatch) -> dict[str, Any]:
        source = await self._own_file(caller, body.input_file_id)
        content = await self.files.content(source.file_id)
        # Up to 64 MB of JSON: parsed beside the loop, whose streams go on meanwhile.
        lines = await asyncio.to_thread(input_lines, content, body.endpoint)
        batch = StoredBatch(
            f"batch_{uuid.uuid4().hex}",
            caller.user_id,
            source.file_id,
            body.endpoint,
            body.completion_window,
            len(lines),
            body.metadata,
            _now(),
            None,
        )
        await self.batches.create(batch)
        try:
            deadline_ms = 1000 * _epoch(batch.created_at + COMPLETION_WINDOW)
            await send_lines(self._producer, api_key, batch.batch_id, lines, deadline_ms)
        except KafkaError as exc:
            await self._withdraw(batch)
            raise unavailable("the batch could not be queued (Kafka)") from exc
        # No read from here on: a failure now would answer "nothing was changed" to a
        # batch that runs, and the client's retry would run it twice.
        return _batch_object(batch, Answered())

    async def _withdraw(self, batch: StoredBatch) -> None:
        """A batch only part queued: admission answers the lines that got out and are
        not forwarded yet as cancelled (that mark first), and the batch is no longer
        listed or found (whatever Redis says: the answer is a 503 either way)."""
        key = batch_cancel_key(batch.user_id, batch.batch_id)
        try:
            await self._redis.set(key, 1, ex=BATCH_LINE_TTL_S)
        except REDIS_DOWN as exc:
            log.warning("%s: lines already queued may run (%s)", batch.batch_id, exc)
        await self.batches.delete(batch)

    async def retrieve(self, caller: Principal, batch_id: str) -> dict[str, Any]:
        return await self._object(await self._own_batch(caller, batch_id))

    async def list(self, caller: Principal, limit: int, after: str | None) -> dict[str, Any]:
        since = await self._own_batch(caller, after) if after else None
        ids = await self.batches.of_user(caller.user_id, limit + 1, since)
        data = await asyncio.gather(*(self.retrieve(caller, batch_id) for batch_id in ids[:limit]))
        return _page(data, has_more=len(ids) > limit)

    async def cancel(self, caller: Principal, batch_id: str) -> dict[str, Any]:
        batch = await self._own_batch(caller, batch_id)
        shown = await self._object(batch)
        if shown["status"] in ("completed", "expired"):  # a cancel would rewrite its end
            raise ApiError(
                409, f"the batch is {shown['status']}: nothing to cancel", kind="conflict_error"
            )
        if batch.cancelled_at is not None:
            return shown
        return await self._object(await self._cancel(batch))

    async def _cancel(self, batch: StoredBatch) -> StoredBatch:
        key = batch_cancel_key(batch.user_id, batch.batch_id)
        await self._redis.set(key, 1, ex=BATCH_LINE_TTL_S)  # admission reads it first
        at = _now()
        await self.batches.cancel(batch.batch_id, at)
        return dataclasses.replace(batch, cancelled_at=at)

    async def _object(self, batch: StoredBatch) -> dict[str, Any]:
        if batch.settled is not None:
            return _batch_object(batch, batch.settled)
        answered = await self.batches.answered(batch.user_id, batch.batch_id)
        if _settled(batch, answered):
            try:
                await self.batches.settle(batch.batch_id, answered)
            except CASSANDRA_DOWN as exc:  # counted again next time: still right
                log.warning("%s: counts not kept (%r)", batch.batch_id, exc)
        return _batch_object(batch, answered)

    async def _batch_file(
        self, caller: Principal, file_id: str
    ) -> tuple[StoredBatch, AsyncIterator[bytes]]:
        output = file_id.startswith(OUTPUT_PREFIX)
        batch_id = file_id.removeprefix(OUTPUT_PREFIX if output else ERROR_PREFIX)
        batch = await self._own_batch(caller, batch_id, what=f"file {file_id}")
        chunks = self.batches.output_lines(batch.user_id, batch.batch_id, succeeded=output)
        return batch, await _first_read(chunks)

    async def _own_file(self, caller: Principal, file_id: str) -> StoredFile:
        stored = await self.files.get(file_id)
        if stored is None or stored.user_id != caller.user_id:
            raise not_found(f"file {file_id}")  # someone else's looks the same
        return stored

    async def _file_cursor(self, caller: Principal, after: str) -> StoredFile:
        """Where a page of files ends. Its last file may be gone already (the usual
        clean-up deletes each file as it is listed): its id tells where it was. Another
        user's file is no cursor."""
        stored = await self.files.get(after)
        if stored is None and (created := _file_created(after)) is not None:
            return StoredFile(after, caller.user_id, "batch", "", 0, created)
        if stored is None or stored.user_id != caller.user_id:
            raise not_found(f"file {after}")
        return stored

    async def _own_batch(self, caller: Principal, batch_id: str, what: str = "") -> StoredBatch:
        batch = await self.batches.get(batch_id) if batch_id else None  # Cassandra: 500
        if batch is None or batch.user_id != caller.user_id:
            raise not_found(what or f"batch {batch_id}")
        return batch


async def _first_read(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """`chunks`, its first page already read: Cassandra down is a 503 before the
    response starts, not a 200 cut short."""
    first = await anext(chunks, None)

    async def all_chunks() -> AsyncIterator[bytes]:
        if first is not None:
            yield first
        async for chunk in chunks:
            yield chunk

    return all_chunks()


def _numbered_lines(content: bytes) -> Iterator[tuple[int, bytes]]:
    """The lines that are not blank, with their numbers (split as bytes.splitlines
    does), found one at a time in linear time: a file of 64 MiB of newlines was 64
    million line objects (650 MB, 3 s) before the cap on lines could say no. A byte
    order mark that starts the file (Windows tools write one) is not part of line 1."""
    number, start = 1, len(codecs.BOM_UTF8) if content.startswith(codecs.BOM_UTF8) else 0
    for found in NOT_BLANK.finditer(content, start):
        between = (start, found.start())
        number += content.count(b"\n", *between) + content.count(b"\r", *between)
        number -= content.count(b"\r\n", *between)
        start = found.start()
        yield number, found.group()


def input_lines(content: bytes, endpoint: str) -> list[bytes]:
    """The file's lines, each checked as far as the batch as a whole needs: JSON with a
    unique custom_id, for the batch's endpoint. What each request asks is checked by
    admission, which answers a bad one with an error line."""
    lines, seen = [], set()
    for number, raw in _numbered_lines(content):
        if len(raw) > MAX_LINE_BYTES:  # Kafka would refuse it half-way through the batch
            raise ApiError(
                400, f"line {number} is {len(raw)} bytes: at most {MAX_LINE_BYTES}", param=PARAM
            )
        try:
            line = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ApiError(400, f"line {number} is not JSON: {exc}", param=PARAM) from exc
        custom_id = line.get("custom_id") if isinstance(line, dict) else None
        if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID_CHARS:
            raise ApiError(400, f"line {number} has no valid custom_id", param=PARAM)
        if custom_id in seen:
            raise ApiError(
                400, f"line {number}: custom_id {custom_id!r} is used twice", param=PARAM
            )
        if line.get("url") != endpoint:
            raise ApiError(400, f"line {number}: url must be {endpoint}", param=PARAM)
        seen.add(custom_id)
        lines.append(raw)
        if len(lines) > MAX_LINES:  # said before the rest is parsed
            raise ApiError(400, f"more than {MAX_LINES} lines", param=PARAM)
    if not lines:
        raise ApiError(400, "the input file has no lines", param=PARAM)
    return lines


def _batch_object(batch: StoredBatch, answered: Answered) -> dict[str, Any]:
    """OpenAI's batch object, from the lines answered so far."""
    completed, failed = answered.succeeded, answered.failed
    status = _status(batch, answered)
    final = status in ("completed", "cancelled", "expired")
    created, expires = _epoch(batch.created_at), _epoch(batch.created_at + COMPLETION_WINDOW)
    cancel_shown = status in ("cancelling", "cancelled")
    cancelling = _epoch(batch.cancelled_at) if batch.cancelled_at and cancel_shown else None
    return {
        "id": batch.batch_id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "errors": None,
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": status,
        "output_file_id": OUTPUT_PREFIX + batch.batch_id if final and completed else None,
        "error_file_id": ERROR_PREFIX + batch.batch_id if final and failed else None,
        "created_at": created,
        "in_progress_at": created,
        "expires_at": expires,
        "finalizing_at": None,
        "completed_at": _epoch(answered.last_at or _now()) if status == "completed" else None,
        "failed_at": None,
        "expired_at": expires if status == "expired" else None,
        "cancelling_at": cancelling,
        "cancelled_at": cancelling if status == "cancelled" else None,
        "request_counts": {"total": batch.total, "completed": completed, "failed": failed},
        "metadata": batch.metadata,
    }


def _settled(batch: StoredBatch, answered: Answered) -> bool:
    """No answer can change these counts any more: every line is answered, and the
    batch is completed or cancelled. An expired batch still counts lines that were
    running at the window's end."""
    done = answered.count >= batch.total
    return done and _status(batch, answered) in ("completed", "cancelled")


def _status(batch: StoredBatch, answered: Answered) -> str:
    done = answered.count >= batch.total
    window_end = batch.created_at + COMPLETION_WINDOW
    if _cancelled_in_time(batch, answered, done):  # unanswered lines end with the window
        return "cancelled" if done or _now() > window_end else "cancelling"
    # A line with no HTTP answer in a batch not cancelled is one the window ended
    # (`batch_expired`). Expired is final: lines still running at the window's end
    # that finish later are counted, and the batch does not turn `completed` (clients
    # stop polling at expired and would never see it).
    last = answered.last_at
    in_window = last is None or last.replace(tzinfo=None) <= window_end
    if _now() > window_end and not (done and not answered.unstatused and in_window):
        return "expired"
    return "completed" if done else "in_progress"


def _cancelled_in_time(batch: StoredBatch, answered: Answered, done: bool) -> bool:
    """A cancel counts unless every line was answered before it: it read the batch in
    progress, the last line finished meanwhile, and clients saw it completed."""
    if batch.cancelled_at is None:
        return False
    last = answered.last_at
    return not (done and last is not None and last.replace(tzinfo=None) <= batch.cancelled_at)


def _page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """OpenAI's cursor page: the next one starts `after` its last id."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def _file_object(stored: StoredFile) -> dict[str, Any]:
    return {
        "id": stored.file_id,
        "object": "file",
        "bytes": stored.bytes,
        "created_at": _epoch(stored.created_at),
        "filename": stored.filename,
        "purpose": stored.purpose,
        "status": "processed",
    }


def _file_id(created: dt.datetime) -> str:
    """An upload's id names its millisecond, so a page may end at a deleted file."""
    ms = (created - EPOCH) // dt.timedelta(milliseconds=1)
    return f"file-t{ms:012x}{uuid.uuid4().hex[:20]}"  # "t": no uuid4 hex id looks so


def _file_created(file_id: str) -> dt.datetime | None:
    """When a file with this id was uploaded, if its id says so."""
    stamp = re2.fullmatch(r"file-t([0-9a-f]{12})[0-9a-f]{20}", file_id)
    if stamp is None:
        return None  # an id from before ids named their time
    return EPOCH + dt.timedelta(milliseconds=int(stamp.group(1), 16))


def _now() -> dt.datetime:
    """Naive UTC to the millisecond, as Cassandra's driver gives timestamps back."""
    now = dt.datetime.now(dt.UTC).replace(tzinfo=None)
    return now.replace(microsecond=now.microsecond // 1000 * 1000)


def _epoch(at: dt.datetime) -> int:
    return int(at.replace(tzinfo=dt.UTC).timestamp())


def _is_unicode(text: str) -> bool:
    """No lone surrogate: Cassandra's driver fails to encode one after registering the
    query (a false "unreachable", and a stream id of the connection lost)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True
