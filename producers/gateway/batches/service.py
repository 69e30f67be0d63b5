"""Files and batches as OpenAI's API shows them, built on `batch.requests`: creating a
batch checks its input file's lines and writes them to the topic with the caller's
key, exactly as any Kafka client may; admission checks, charges and runs each line, and
the outputs stored per line (`batch_outputs`) make the batch's progress and its output
and error files."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Mapping,
)
from typing import Annotated, Any, Literal

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from pydantic import BaseModel, ConfigDict, Field

from producers.batch_topic import CommitUnknown, send_all_or_none
from producers.gateway.batches.enqueued import QueueCap, Room
from producers.gateway.batches.input_file import input_lines
from producers.gateway.batches.objects import (
    ERROR_PREFIX,
    OUTPUT_PREFIX,
    batch_object,
    file_created,
    file_object,
    is_settled,
    new_file_id,
    page,
    utc_now,
    window_end_ms,
)
from producers.gateway.batches.records import Answered, StoredBatch, StoredFile
from producers.gateway.batches.store import BatchStore, FileStore, Order
from producers.gateway.errors import NOT_RETRIED, ApiError, not_found, unavailable
from tandoor.background import Background
from tandoor.clients import CASSANDRA_DOWN, REDIS_DOWN
from tandoor.policies.api_keys import Principal
from tandoor.policies.redis_keys import BATCH_LINE_TTL_S, batch_cancel_key
from tandoor.settings import DEFAULT_TIERS, MAX_USER_FILE_BYTES, TierPolicy

log = logging.getLogger(__name__)


# OpenAI's limits: 16 pairs, keys up to 64 characters, values up to 512.
MetadataKey = Annotated[str, Field(max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=200)
    endpoint: Literal["/v1/chat/completions"]
    completion_window: Literal["24h"]
    metadata: dict[MetadataKey, MetadataValue] | None = Field(default=None, max_length=16)


MARK_RETRY_S = (1, 2, 4, 8, 16, 32)  # 63 s in all: within QUEUING_LIMIT
BATCHES_CREATED_AT_ONCE = 2  # per replica; more wait their turn
CREATE_WAIT_S = 30.0  # for a turn, then a 503 (the SDK retries it)
MAX_USER_FILES = 10_000  # kept at once by one user: ten pages of rows read at each upload


class BatchService:
    def __init__(
        self,
        session: Any,
        make_producer: Callable[[str], AIOKafkaProducer],
        redis: Any,
        max_user_bytes: int = MAX_USER_FILE_BYTES,
        tiers: Mapping[str, TierPolicy] = DEFAULT_TIERS,
        max_user_files: int = MAX_USER_FILES,
    ) -> None:
        self.files = FileStore(session)
        self._max_user_bytes = max_user_bytes
        self._max_user_files = max_user_files
        # Batches created at once: each holds up to twice its input file in memory (its
        # bytes, then its lines) until its lines are sent; many ran a replica out of it.
        self._creating = asyncio.Semaphore(BATCHES_CREATED_AT_ONCE)
        self.batches = BatchStore(session)
        self._queue_cap = QueueCap(self.batches, tiers)
        self._make_producer = make_producer  # one per batch: its lines are one transaction
        self._redis = redis
        self.background = Background()  # marks of batches queued, once they can be

    # Files.

    async def upload(
        self,
        caller: Principal,
        filename: str,
        purpose: str,
        data: bytes | AsyncIterable[bytes],
        size: int | None = None,
    ) -> dict[str, Any]:
        """`size`: of `data` read in pieces, where known (a multipart upload's). What the
        user holds is looked at before each upload: uploads at once may each pass."""
        if purpose != "batch":
            raise ApiError(400, "only purpose 'batch' is supported", param="purpose")
        if not _is_unicode(filename):  # a multipart charset may decode to half a pair
            raise ApiError(400, "the file's name is not valid Unicode text", param="file")
        size = len(data) if isinstance(data, bytes) else size
        if size == 0:  # stored, each was a row more to read at every upload, for nothing
            raise ApiError(400, "the file is empty: a batch needs a request a line", param="file")
        held = await self.files.held_by(caller.user_id)
        if held.files >= self._max_user_files:  # its rows are read at every upload
            raise ApiError(
                409,
                f"you keep {held.files} files, the most one user may: delete some first",
                param="file",
                headers=NOT_RETRIED,
            )
        if held.bytes + (size or 0) > self._max_user_bytes:  # storage without end
            raise ApiError(
                413,
                f"your files hold {held.bytes} bytes and this one {size or 0}; the most one "
                f"user may keep is {self._max_user_bytes}: delete some first",
                param="file",
            )
        created = utc_now()
        stored = StoredFile(
            new_file_id(created), caller.user_id, purpose, filename[:256], 0, created
        )
        return file_object(await self.files.create(stored, data))

    async def file(self, caller: Principal, file_id: str) -> dict[str, Any]:
        if file_id.startswith((OUTPUT_PREFIX, ERROR_PREFIX)):
            batch, chunks = await self._batch_file(caller, file_id)
            size = sum([len(chunk) async for chunk in chunks])
            kind = "output" if file_id.startswith(OUTPUT_PREFIX) else "error"
            name = f"{batch.batch_id}_{kind}.jsonl"
            # The batch's time: the file is made from its answers when read, and a time of
            # the call made the same file new on every read.
            made = StoredFile(file_id, caller.user_id, "batch_output", name, size, batch.created_at)
            return file_object(made)
        return file_object(await self._own_file(caller, file_id))

    async def content(
        self, caller: Principal, file_id: str
    ) -> tuple[AsyncIterator[bytes], int | None]:
        """A file's bytes as they are read (its owner checked, its first page read), and
        its size where known before reading it (an upload's)."""
        if file_id.startswith((OUTPUT_PREFIX, ERROR_PREFIX)):
            return (await self._batch_file(caller, file_id))[1], None
        stored = await self._own_file(caller, file_id)
        return await _first_read(self.files.chunks(file_id)), stored.bytes

    async def delete_file(self, caller: Principal, file_id: str) -> dict[str, Any]:
        await self.files.delete(await self._own_file(caller, file_id))
        return {"id": file_id, "object": "file", "deleted": True}

    async def list_files(
        self, caller: Principal, limit: int, order: Order, after: str | None, purpose: str | None
    ) -> dict[str, Any]:
        """The caller's uploads (a batch's output and error files are reached from it)."""
        if purpose not in (None, "batch"):  # the only purpose an upload may have here
            return page([], has_more=False)
        since = await self._file_cursor(caller, after) if after else None
        found = await self.files.of_user(caller.user_id, limit + 1, order, since)
        return page([file_object(f) for f in found[:limit]], has_more=len(found) > limit)

    # Batches.

    async def create(self, caller: Principal, api_key: str, body: CreateBatch) -> dict[str, Any]:
        source = await self._own_file(caller, body.input_file_id)
        async with self._queue_cap.room(caller) as room:  # a user with none: told now
            try:
                async with asyncio.timeout(CREATE_WAIT_S):
                    await self._creating.acquire()
            except TimeoutError:
                raise unavailable("other batches are being created: retry shortly") from None
            try:  # until its lines are sent: held till then
                return await self._create(caller, api_key, body, source, room)
            finally:
                self._creating.release()

    async def _create(
        self, caller: Principal, api_key: str, body: CreateBatch, source: StoredFile, room: Room
    ) -> dict[str, Any]:
        content = await self.files.content(source.file_id)
        # Up to 64 MB of JSON: parsed beside the loop, whose streams go on meanwhile.
        lines = await asyncio.to_thread(input_lines, content, body.endpoint)
        del content
        batch = StoredBatch(
            f"batch_{uuid.uuid4().hex}",
            caller.user_id,
            source.file_id,
            body.endpoint,
            body.completion_window,
            len(lines),
            body.metadata,
            utc_now(),
            None,
            queuing=True,
        )
        room.take(len(lines))
        await self.batches.create(batch)
        deadline_ms = window_end_ms(batch)
        try:
            await send_all_or_none(self._make_producer, api_key, batch.batch_id, lines, deadline_ms)
        except KafkaError as exc:  # no line got out: nothing is kept
            await self.batches.delete(batch)
            raise unavailable("the batch could not be queued (Kafka)") from exc
        except CommitUnknown as unknown:  # answered `validating`; marked once Kafka says
            log.warning("%s: sent, its commit not answered yet", batch.batch_id)
            self.background.start(self._mark_once_committed(batch.batch_id, unknown.committed))
            return batch_object(batch, Answered())
        # No failure from here on: it would answer "nothing was changed" to a batch that
        # runs, and the client's retry would run it twice.
        await self._mark_queued(batch.batch_id)
        return batch_object(dataclasses.replace(batch, queuing=False), Answered())

    async def _mark_once_committed(self, batch_id: str, committed: Awaitable[bool]) -> None:
        if await committed:
            await self._mark_queued(batch_id)
        else:  # aborted: none of its lines runs, and it shows `failed` in time
            log.error("%s: its lines' commit failed; none of them runs", batch_id)

    async def _mark_queued(self, batch_id: str) -> None:
        """Unmarked, a batch whose lines are in Kafka would show `failed` once
        QUEUING_LIMIT has passed (until its first line is answered): a store that fails
        now is tried again in the background, well within that limit."""
        try:
            await self.batches.queued(batch_id)
        except CASSANDRA_DOWN as exc:
            log.warning("%s: queued, not yet marked so (%s); trying again", batch_id, exc)
            self.background.start(self._mark_queued_later(batch_id))

    async def _mark_queued_later(self, batch_id: str) -> None:
        for delay_s in MARK_RETRY_S:
            await asyncio.sleep(delay_s)
            try:
                await self.batches.queued(batch_id)
                return
            except CASSANDRA_DOWN as exc:
                failure = exc
        log.error("%s: queued, never marked so; it shows failed (%s)", batch_id, failure)

    async def retrieve(self, caller: Principal, batch_id: str) -> dict[str, Any]:
        return await self._object(await self._own_batch(caller, batch_id))

    async def list(self, caller: Principal, limit: int, after: str | None) -> dict[str, Any]:
        since = await self._own_batch(caller, after) if after else None
        ids = await self.batches.of_user(caller.user_id, limit + 1, since)
        found = await asyncio.gather(*(self.batches.get(batch_id) for batch_id in ids[:limit]))
        # A listed id without its row (a create withdrawn, or a write half-seen, between
        # the two reads) is left out: it made the whole page a 404.
        mine = [b for b in found if b is not None and b.user_id == caller.user_id]
        data = await asyncio.gather(*(self._object(batch) for batch in mine))
        return page(data, has_more=len(ids) > limit)

    async def cancel(self, caller: Principal, batch_id: str) -> dict[str, Any]:
        batch = await self._own_batch(caller, batch_id)
        shown = await self._object(batch)
        # A cancel would rewrite its end; a `failed` one's lines may have been queued
        # after all (its mark was lost): cancelled, none of them runs.
        if shown["status"] in ("completed", "expired") or (
            shown["status"] == "failed" and not batch.queuing
        ):
            raise ApiError(
                409,
                f"the batch is {shown['status']}: nothing to cancel",
                kind="conflict_error",
                headers=NOT_RETRIED,
            )
        return await self._object(await self._cancel(batch))

    async def _cancel(self, batch: StoredBatch) -> StoredBatch:
        """Stored first, then told to admission: told first, a store that failed left
        its lines answered `batch_cancelled` while the batch showed `completed` (and
        the client's retry a 409). Each retry tells admission again."""
        at = batch.cancelled_at or utc_now()
        if batch.cancelled_at is None:
            await self.batches.cancel(batch.batch_id, at)
        key = batch_cancel_key(batch.user_id, batch.batch_id)
        try:
            await self._redis.set(key, 1, ex=BATCH_LINE_TTL_S)
        except REDIS_DOWN as exc:  # not "nothing was changed": the cancel is stored
            raise unavailable(
                "the cancel is stored but not yet in effect (Redis is unreachable): lines "
                "still run until it is retried",
                changed=True,
            ) from exc
        return dataclasses.replace(batch, cancelled_at=at)

    async def _object(self, batch: StoredBatch) -> dict[str, Any]:
        if batch.settled is not None:
            return batch_object(batch, batch.settled)
        answered = await self.batches.answered(batch.user_id, batch.batch_id)
        if is_settled(batch, answered):
            try:
                await self.batches.settle(batch.batch_id, answered)
            except CASSANDRA_DOWN as exc:  # counted again next time: still right
                log.warning("%s: counts not kept (%r)", batch.batch_id, exc)
        return batch_object(batch, answered)

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
        if stored is None and (created := file_created(after)) is not None:
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


def _is_unicode(text: str) -> bool:
    """No lone surrogate: Cassandra's driver fails to encode one after registering the
    query (a false "unreachable", and a stream id of the connection lost)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True
