"""Files and batches in Cassandra (infra/migrations/0006_files_and_batches.cql,
0007_files_by_user.cql, 0008_batch_summary.cql)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any, Literal

from cassandra import Unavailable
from cassandra.cluster import NoHostAvailable
from cassandra.query import SimpleStatement

from producers.gateway.batches.records import Answered, Held, StoredBatch, StoredFile
from tandoor.clients import cql, cql_pages, cql_together

NOT_WRITTEN = (NoHostAvailable, Unavailable)  # refused before any replica wrote

CHUNK_BYTES = 512 * 1024  # a file's bytes in rows of this size, in one partition
CHUNKS_A_PAGE = 2  # read back a megabyte at a time
# An output line holds a whole reply (tens of KB): the driver's pages of 5,000 held
# ~100 MB for each download at once.
OUTPUT_LINES_A_PAGE = 100
Order = Literal["asc", "desc"]


class FileStore:
    def __init__(self, session: Any) -> None:
        self._session = session
        self._insert_chunk_statement: Any = None

    async def _insert_chunk(self) -> Any:
        """Prepared: a blob bound as text (hex in the statement) took four times its size
        in memory while being sent. Beside the loop: the driver's prepare blocks."""
        if self._insert_chunk_statement is None:
            self._insert_chunk_statement = await asyncio.to_thread(
                self._session.prepare,
                "INSERT INTO file_chunks (file_id, chunk, data) VALUES (?, ?, ?)",
            )
        return self._insert_chunk_statement

    async def create(self, stored: StoredFile, content: bytes | AsyncIterable[bytes]) -> StoredFile:
        """The chunks as they are read (64 MiB held whole by each of a few uploads ran a
        replica out of memory), then the rows that make the file visible and listed."""
        size, number, rows_sent = 0, 0, False
        insert = await self._insert_chunk()
        try:
            async for chunk in _chunks_of(content):
                await cql(self._session, insert, (stored.file_id, number, chunk), True)
                size, number = size + len(chunk), number + 1
            stored, rows_sent = dataclasses.replace(stored, bytes=size), True
            row = (stored.purpose, stored.filename, stored.bytes)
            await cql_together(  # visible and listed together, or neither
                self._session,
                [
                    (
                        "INSERT INTO files (file_id, user_id, created_at, purpose, filename, "
                        "bytes) VALUES (%s, %s, %s, %s, %s, %s)",
                        (stored.file_id, stored.user_id, stored.created_at, *row),
                    ),
                    (
                        "INSERT INTO files_by_user (user_id, created_at, file_id, purpose, "
                        "filename, bytes) VALUES (%s, %s, %s, %s, %s, %s)",
                        (stored.user_id, stored.created_at, stored.file_id, *row),
                    ),
                ],
            )
        except BaseException as exc:  # cut short (Cassandra, a cancel): chunks stored for ever
            if not rows_sent or isinstance(exc, NOT_WRITTEN):  # a timeout's rows may be written
                forget = cql(
                    self._session, "DELETE FROM file_chunks WHERE file_id = %s", (stored.file_id,)
                )
                with contextlib.suppress(Exception):
                    await asyncio.shield(forget)
            raise
        return stored

    async def get(self, file_id: str) -> StoredFile | None:
        rows = await cql(
            self._session,
            "SELECT file_id, user_id, purpose, filename, bytes, created_at FROM files "
            "WHERE file_id = %s",
            (file_id,),
        )
        return StoredFile(*rows[0]) if rows else None

    async def content(self, file_id: str) -> bytes:
        return b"".join([chunk async for chunk in self.chunks(file_id)])

    async def chunks(self, file_id: str) -> AsyncIterator[bytes]:
        """The file's bytes a chunk at a time (the driver's pages of 5,000 rows held a
        64 MiB file whole, for each download at once)."""
        statement = SimpleStatement(
            "SELECT data FROM file_chunks WHERE file_id = %s", fetch_size=CHUNKS_A_PAGE
        )
        async for rows in cql_pages(self._session, statement, (file_id,), large=True):
            for row in rows:
                yield row.data

    async def held_by(self, user_id: str) -> Held:
        """The files the user has uploaded and not deleted: how many, and their bytes."""
        statement = SimpleStatement(
            "SELECT bytes FROM files_by_user WHERE user_id = %s", fetch_size=1000
        )
        pages = cql_pages(self._session, statement, (user_id,))
        sizes = [row.bytes async for rows in pages for row in rows]
        return Held(len(sizes), sum(sizes))

    async def of_user(
        self, user_id: str, limit: int, order: Order, after: StoredFile | None
    ) -> list[StoredFile]:
        """Up to `limit` of the user's files in `order` of creation, after `after`: the
        rest of its millisecond first (uploads may share one), then later ones."""
        if after is None:
            return await self._listed(user_id, "", (), order, limit)
        newer, later = (">", "<") if order == "desc" else ("<", ">")  # file_id, created_at
        same_ms = await self._listed(
            user_id,
            f" AND created_at = %s AND file_id {newer} %s",
            (after.created_at, after.file_id),
            order,
            limit,
        )
        if len(same_ms) == limit:
            return same_ms
        rest = await self._listed(
            user_id, f" AND created_at {later} %s", (after.created_at,), order, limit - len(same_ms)
        )
        return same_ms + rest

    async def _listed(
        self, user_id: str, where: str, params: tuple[Any, ...], order: Order, limit: int
    ) -> list[StoredFile]:
        direction = "DESC" if order == "desc" else "ASC"
        rows = await cql(
            self._session,
            "SELECT file_id, user_id, purpose, filename, bytes, created_at FROM files_by_user "
            f"WHERE user_id = %s{where} ORDER BY created_at {direction} LIMIT %s",
            (user_id, *params, limit),
        )
        return [StoredFile(*row) for row in rows]

    async def delete(self, stored: StoredFile) -> None:
        """All three tables in one batch: a delete cut short after the file's row left
        its bytes stored where no retry could reach them (the file answered 404)."""
        await cql_together(
            self._session,
            [
                (
                    "DELETE FROM files_by_user WHERE user_id = %s AND created_at = %s "
                    "AND file_id = %s",
                    (stored.user_id, stored.created_at, stored.file_id),
                ),
                ("DELETE FROM files WHERE file_id = %s", (stored.file_id,)),
                ("DELETE FROM file_chunks WHERE file_id = %s", (stored.file_id,)),
            ],
        )


class BatchStore:
    def __init__(self, session: Any) -> None:
        self._session = session

    async def create(self, batch: StoredBatch) -> None:
        await cql_together(  # readable and listed together, or neither
            self._session,
            [
                (
                    "INSERT INTO api_batches (batch_id, user_id, input_file_id, endpoint, "
                    "completion_window, total, metadata, metadata_given, created_at, "
                    "queuing) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
                    (
                        batch.batch_id,
                        batch.user_id,
                        batch.input_file_id,
                        batch.endpoint,
                        batch.completion_window,
                        batch.total,
                        batch.metadata,
                        batch.metadata is not None,
                        batch.created_at,
                        batch.queuing,
                    ),
                ),
                (
                    "INSERT INTO batches_by_user (user_id, created_at, batch_id) "
                    "VALUES (%s, %s, %s)",
                    (batch.user_id, batch.created_at, batch.batch_id),
                ),
            ],
        )

    async def queued(self, batch_id: str) -> None:
        await cql(
            self._session,
            "UPDATE api_batches SET queuing = false WHERE batch_id = %s",
            (batch_id,),
        )

    async def delete(self, batch: StoredBatch) -> None:
        await cql_together(
            self._session,
            [
                (
                    "DELETE FROM batches_by_user WHERE user_id = %s AND created_at = %s "
                    "AND batch_id = %s",
                    (batch.user_id, batch.created_at, batch.batch_id),
                ),
                ("DELETE FROM api_batches WHERE batch_id = %s", (batch.batch_id,)),
            ],
        )

    async def get(self, batch_id: str) -> StoredBatch | None:
        rows = await cql(
            self._session,
            "SELECT batch_id, user_id, input_file_id, endpoint, completion_window, total, "
            "metadata, created_at, cancelled_at, settled_succeeded, settled_failed, "
            "settled_unstatused, settled_last_at, metadata_given, queuing FROM api_batches "
            "WHERE batch_id = %s",
            (batch_id,),
        )
        if not rows:
            return None
        *stored, succeeded, failed, unstatused, last_at, metadata_given, queuing = rows[0]
        found = StoredBatch(*stored)
        metadata = dict(found.metadata or {}) if metadata_given or found.metadata else None
        settled = None
        if succeeded is not None:
            settled = Answered(succeeded, failed, unstatused, _utc(last_at))
        return dataclasses.replace(found, metadata=metadata, settled=settled, queuing=bool(queuing))

    async def of_user(self, user_id: str, limit: int, after: StoredBatch | None) -> list[str]:
        """Batch ids, newest first, after `after` (a page's last): the rest of its
        millisecond first (batches may share one), then older ones."""
        if after is None:
            return await self._listed(user_id, "", (), limit)
        same_ms = await self._listed(
            user_id,
            " AND created_at = %s AND batch_id > %s",
            (after.created_at, after.batch_id),
            limit,
        )
        if len(same_ms) == limit:
            return same_ms
        older = await self._listed(
            user_id, " AND created_at < %s", (after.created_at,), limit - len(same_ms)
        )
        return same_ms + older

    async def created_since(self, user_id: str, since: dt.datetime) -> AsyncIterator[list[str]]:
        """The user's batch ids created after `since`, newest first, a page at a time."""
        pages = cql_pages(
            self._session,
            "SELECT batch_id FROM batches_by_user WHERE user_id = %s AND created_at > %s",
            (user_id, since),
        )
        async for page in pages:
            yield [row.batch_id for row in page]

    async def _listed(
        self, user_id: str, where: str, params: tuple[Any, ...], limit: int
    ) -> list[str]:
        rows = await cql(
            self._session,
            f"SELECT batch_id FROM batches_by_user WHERE user_id = %s{where} LIMIT %s",
            (user_id, *params, limit),
        )
        return [row.batch_id for row in rows]

    async def cancel(self, batch_id: str, at: dt.datetime) -> None:
        await cql(
            self._session,
            "UPDATE api_batches SET cancelled_at = %s WHERE batch_id = %s",
            (at, batch_id),
        )

    async def answered(self, user_id: str, batch_id: str) -> Answered:
        """The lines answered so far, counted a page at a time (a batch may have 50,000)."""
        codes: list[int | None] = []
        last_us = 0
        pages = cql_pages(
            self._session,
            "SELECT status_code, toUnixTimestamp(answered_at) AS answered_ms, "
            "WRITETIME(output) AS written FROM batch_outputs "
            "WHERE user_id = %s AND batch_id = %s",
            (user_id, batch_id),
        )
        async for page in pages:
            codes += (row.status_code for row in page)
            last_us = max([last_us, *(_answered_us(row) for row in page)])
        last = dt.datetime.fromtimestamp(last_us / 1e6, dt.UTC) if last_us else None
        return Answered.of(codes, last)

    async def answered_count(self, user_id: str, batch_id: str) -> int:
        """How many of its lines are answered, counted by Cassandra (one partition)."""
        rows = await cql(
            self._session,
            "SELECT COUNT(*) AS answered FROM batch_outputs WHERE user_id = %s AND batch_id = %s",
            (user_id, batch_id),
        )
        return int(rows[0].answered)

    async def settle(self, batch_id: str, answered: Answered) -> None:
        """Keep a finished batch's counts on its row: every later read of it is one row,
        not every line's answer again (the list reads each batch on its page)."""
        await cql(
            self._session,
            "UPDATE api_batches SET settled_succeeded = %s, settled_failed = %s, "
            "settled_unstatused = %s, settled_last_at = %s WHERE batch_id = %s",
            (answered.succeeded, answered.failed, answered.unstatused, answered.last_at, batch_id),
        )

    async def output_lines(
        self, user_id: str, batch_id: str, succeeded: bool
    ) -> AsyncIterator[bytes]:
        """The output file (`succeeded`) or the error file, in custom_id order, a chunk
        of lines per page read: a 50,000-line batch is never held whole."""
        statement = SimpleStatement(
            "SELECT status_code, output FROM batch_outputs WHERE user_id = %s AND batch_id = %s",
            fetch_size=OUTPUT_LINES_A_PAGE,
        )
        pages = cql_pages(self._session, statement, (user_id, batch_id))
        async for page in pages:
            picked = [row.output.encode() for row in page if (row.status_code == 200) == succeeded]
            if picked:
                yield b"".join(line + b"\n" for line in picked)


def _utc(at: dt.datetime | None) -> dt.datetime | None:
    """The driver reads timestamps back without a zone; they are UTC."""
    return at.replace(tzinfo=dt.UTC) if at is not None and at.tzinfo is None else at


async def _chunks_of(content: bytes | AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """`content` in CHUNK_BYTES pieces, whether whole or read in pieces of any size."""
    if isinstance(content, bytes):
        for i in range(0, len(content), CHUNK_BYTES):
            yield content[i : i + CHUNK_BYTES]
        return
    held = bytearray()
    async for piece in content:
        held += piece
        while len(held) >= CHUNK_BYTES:
            yield bytes(held[:CHUNK_BYTES])
            del held[:CHUNK_BYTES]
    if held:
        yield bytes(held)


def _answered_us(row: Any) -> int:
    """When a line was answered (its write time, for an output stored before the column)."""
    return int(row.answered_ms * 1000 if row.answered_ms is not None else row.written or 0)
