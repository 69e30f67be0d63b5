"""The rollup tables, per user and per model: faust Tables kept in memory with changelog
topics in Kafka (a restarted app recovers them), and the one way they change.

Bounded state, whatever the traffic:
- a rollup holds counts and fixed histograms only (rollups.py);
- a record read again after a restart is known by its offset (each rollup keeps the
  last it counted: its records all come from one partition); a copy of a usage record
  published twice is known by its request id, kept in `counted-by-user` until the
  partition's stream time (the newest finish time it has seen, at most CLOCK_AHEAD_MS
  ahead of the clock) is `streams_dedupe_s` past it, so it holds minutes of traffic,
  not all of it. A copy skipped that way is
  in no rollup's offset, and its id may have expired by the time it is read again, so
  the partition keeps the offset of the last copy it skipped (`\\xffskipped/<partition>`
  in the same table: written before the ids it outlives are dropped). The per-model
  rollups get the records the per-user ones counted, and those read again after a
  crash once more (known there by id alone, so one that lagged past the dedupe span
  counts twice per model: docs/architecture.md), and keep re-runs' ids the same way;
- a rollup is dropped once stream time is `streams_retention_windows` windows past
  its end, and a record read later than that is not counted in it (`passed_over`).
Tables change only inside a stream, on the partition of the record being processed
(faust writes the changelog there), so each partition keeps a book (PartitionBook) of
its own entries and expires them as its records arrive.

Publishing is at a bounded rate: a changed rollup is published to `usage.rollups` at
most once per `streams_publish_s`, and each window once more, marked closed, when it
ends (by stream time, or by the clock when its partition goes quiet).
"""

from __future__ import annotations

import asyncio
import heapq
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from time import monotonic
from typing import Any, Literal

import faust
import orjson
from faust.streams import current_event
from faust.types import TP

from schemas import topics
from schemas.events import now_ms
from streams.outputs import Send
from streams.rollups import WINDOWS_S, Rollup, table_key
from tandoor.settings import Settings

DIMENSIONS = ("user", "model")
RollupKey = tuple[str, int, str, str]  # (window, start_ms, dimension, key)
Counting = Literal["counted", "seen", "replayed"]  # what `count` made of a record
CLOSE_GRACE_MS = 10_000  # records finishing this late still land before "closed"
HOUSEKEEP_EVERY_S = 1.0
REBUILD_SLICE = 2_000  # table entries read between yields to the event loop
# Stream time runs at most this far ahead of this clock: one record stamped by a clock
# gone wrong would otherwise expire every window and counted id of its partition.
CLOCK_AHEAD_MS = 10_000
SKIPPED_PREFIX = b"\xffskipped/"  # 0xff is never in UTF-8: no counted id begins so


@dataclass
class PartitionBook:
    """One table partition's entries: when each expires, what changed, what closed."""

    stream_ms: int = 0  # the newest finish time counted here
    skipped_to: int = -1  # the offset of the last copy skipped by its id
    windows: dict[bytes, tuple[int, int]] = field(default_factory=dict)  # key: (end, expiry)
    # (at_ms, id), a min-heap: arrival order is not time order (a re-run's final of now
    # before hours of caught-up usage held every id behind it).
    counted: list[tuple[int, bytes]] = field(default_factory=list)
    dirty: set[bytes] = field(default_factory=set)
    closed: set[bytes] = field(default_factory=set)  # published as closed
    sending: set[bytes] = field(default_factory=set)  # taken by a publication under way
    housekept_at: float = 0.0
    # Monotonic: when a record of it was last read; a new book (a start, a rebalance)
    # counts as read now, so the backlog it may have is read before the clock closes.
    read_at: float = field(default_factory=lambda: monotonic())
    # Its partition revoked, and this member not yet told whether it keeps it: not
    # published meanwhile (its new owner may be counting it, and what this one had
    # would end a window with fewer than were counted).
    suspended: bool = False


class RollupTables:
    def __init__(self, app: faust.App, settings: Settings, publish: Send) -> None:
        self._tables = {d: _table(app, f"rollups-by-{d}") for d in DIMENSIONS}
        self._counted = {d: _table(app, f"counted-by-{d}") for d in DIMENSIONS}
        self._retention_windows = settings.streams_retention_windows
        self._dedupe_ms = int(settings.streams_dedupe_s * 1000)
        self._publish = publish
        self._books: dict[tuple[str, int], PartitionBook] = {}
        self.passed_over: Counter[str] = Counter()  # records or windows not counted, by why
        self.quiet_s = CLOSE_GRACE_MS / 1000  # read nothing this long: the clock closes
        for dimension in DIMENSIONS:  # called once every table is recovered
            self._counted[dimension].on_recover(self._on_recovered(app, dimension))
        app.on_partitions_revoked.connect(self._on_revoked)  # type: ignore[arg-type]

    async def _on_revoked(self, _: faust.App, revoked: set[TP], **__: Any) -> None:
        """faust's revoke signal (before the tables are recovered, and before the
        recovery callbacks say which partitions stay: reassigned)."""
        partitions = {tp.partition for tp in revoked}
        for (_dimension, partition), book in self._books.items():
            if partition in partitions:
                book.suspended = True

    def _on_recovered(self, app: faust.App, dimension: str) -> Callable[[], Awaitable[None]]:
        async def recovered() -> None:
            changelog = self._tables[dimension].changelog_topic.get_topic_name()
            actives = app.assignor.assigned_actives()
            owned = {tp.partition for tp in actives if tp.topic == changelog}
            await self.reassigned(dimension, owned)

        return recovered

    async def count(
        self,
        dimension: str,
        record_id: bytes | None,
        at_ms: int,
        keys: list[RollupKey],
        apply: Callable[[Rollup], None],
        advances: bool = True,
    ) -> Counting:
        """Apply the record being processed to each rollup it belongs to, unless it was
        counted before. A rollup's records all come from one partition of its source
        topic (keyed by user, or by model), so a record read again after a restart is
        known by its offset ("replayed"); `record_id`, where given, also catches a copy
        of the record published twice, or read again with its id marked ("seen").
        `advances`: whether its time moves stream time on (what is late, which ids are
        kept); not where a second source shares the topic at its own pace."""
        partition, offset = _position()
        book = self._book(dimension, partition)
        book.read_at = monotonic()
        if offset <= book.skipped_to:
            return "replayed"  # a copy skipped before, read again after a restart
        if record_id is not None and self._counted[dimension].get(record_id) is not None:
            book.skipped_to = offset
            self._counted[dimension][_skipped_key(partition)] = str(offset).encode()
            return "seen"
        table = self._tables[dimension]
        for window, start, _, key in keys:
            name = table_key(window, start, dimension, key).encode()
            stored = table.get(name)
            rollup = Rollup.load(orjson.loads(stored)) if stored else None
            rollup = rollup or Rollup(window, start, dimension, key, partition=partition)
            if rollup.partition == partition and rollup.offset >= offset:
                continue  # read again after a restart: already in this one
            if stored is None and self._expiry(rollup) < book.stream_ms:
                # Its window was published closed and dropped: made again, this one
                # record would replace the final count (a replay, a catch-up).
                self.passed_over["late"] += 1
                continue
            apply(rollup)
            rollup.partition, rollup.offset = partition, offset
            table[name] = orjson.dumps(rollup.dump())
            book.windows[name] = (rollup.end_ms, self._expiry(rollup))
            book.dirty.add(name)
        if record_id is not None:  # after the rollups: a crash between them leaves them
            # applied and the id unmarked, and the replay skips them by their offsets
            # (marked first, the replay skipped the record: it was never counted)
            self._counted[dimension][record_id] = f"{partition}:{at_ms}".encode()
            heapq.heappush(book.counted, (at_ms, record_id))
        if advances:
            _advance(book, at_ms)
        self._housekeep(dimension, book)
        return "counted"

    async def publish_changes(self) -> int:
        """Publish each rollup changed since the last call, and each window that closed;
        returns how many were published."""
        published = 0
        for (dimension, _), book in list(self._books.items()):
            if book.suspended:
                continue
            table = self._tables[dimension]
            # By the clock only where nothing came for the grace: a partition still
            # reading a backlog closed each old minute with its first records.
            quiet = monotonic() - book.read_at >= self.quiet_s
            closing_ms = (
                max(book.stream_ms, now_ms()) if quiet else book.stream_ms
            ) - CLOSE_GRACE_MS
            ended = {name for name, (end, _) in book.windows.items() if end <= closing_ms}
            # Swapped out before the sends: the agent counts on while they wait, and
            # what it marks meanwhile is for the next call, not cleared with these.
            dirty, book.dirty = book.dirty, set()
            book.sending = dirty | (ended - book.closed)  # kept until sent (_housekeep)
            try:
                published += await self._publish_book(book, table, ended)
            finally:
                book.sending = set()
        return published

    async def _publish_book(self, book: PartitionBook, table: Any, ended: set[bytes]) -> int:
        published = 0
        for name in sorted(book.sending):
            if book.suspended:
                book.dirty.add(name)
                continue
            stored = table.get(name)
            if stored is None:
                continue  # taken by a rebalance meanwhile
            closed = name in ended or name in book.closed  # closed stays closed
            await self._publish(name, _summary(stored, closed))
            if closed:
                book.closed.add(name)
            published += 1
        return published

    async def reassigned(self, dimension: str, partitions: set[int]) -> None:
        """After a rebalance, once the tables are recovered: the partitions of
        `dimension` this member owns now. A book of a partition kept stays as it is (what
        changed is still to publish, what closed is not published again); one another
        member took is dropped with its entries (that member publishes them). A partition
        new here gets its book at once, quiet or not, so its windows close by the clock,
        with every window to publish once more: what its last owner had not published
        yet is unknown."""
        for key in [k for k in self._books if k[0] == dimension and k[1] not in partitions]:
            self._forget(dimension, key[1], self._books.pop(key))
        for partition in partitions & {p for d, p in self._books if d == dimension}:
            self._books[(dimension, partition)].suspended = False
        new = partitions - {p for d, p in self._books if d == dimension}
        for partition, book in (await self._books_from_tables(dimension, new)).items():
            book.dirty.update(book.windows)
            self._books[(dimension, partition)] = book

    def _forget(self, dimension: str, partition: int, book: PartitionBook) -> None:
        """Drop a partition another member took from this one's memory, and only from
        it: its changelog is the new owner's now (a delete there would erase its data).
        faust's memory store forgets only the entries it recovered, not those written
        here, which stayed (and were served) until the process ended."""
        rollups, counted = self._tables[dimension].data, self._counted[dimension].data
        for name in book.windows:
            rollups.pop(name, None)
        for _, record_id in book.counted:
            counted.pop(record_id, None)
        counted.pop(_skipped_key(partition), None)

    def summaries(self, dimension: str, key: str) -> list[dict[str, Any]] | None:
        """Every window of one user or model, newest first; None for an unknown dimension."""
        table = self._tables.get(dimension)
        if table is None:
            return None
        prefix = f"{dimension}/{key}/".encode()
        closing_ms = now_ms() - CLOSE_GRACE_MS
        rollups = [
            Rollup.load(orjson.loads(value))
            for name, value in table.items()
            # "<window>/<start>" after it: "alice/" also starts "alice/bob"'s names
            if name.startswith(prefix) and name.count(b"/", len(prefix)) == 1
        ]
        found = [rollup.summary(rollup.end_ms <= closing_ms) for rollup in rollups]
        return sorted(found, key=lambda s: (s["window"], -s["start_ms"]))

    def sizes(self) -> dict[str, int]:
        """Entries held per table, for the metrics and the benchmark."""
        return {
            **{f"rollups-by-{d}": len(t) for d, t in self._tables.items()},
            **{f"counted-by-{d}": len(t) for d, t in self._counted.items()},
        }

    def _expiry(self, rollup: Rollup) -> int:
        return rollup.end_ms + self._retention_windows * WINDOWS_S[rollup.window] * 1000

    def _book(self, dimension: str, partition: int) -> PartitionBook:
        """The partition's book (made by `reassigned`; made here for a record read
        before any rebalance said what this member owns)."""
        book = self._books.get((dimension, partition))
        if book is None:
            book = PartitionBook()
            self._fill_books(dimension, {partition: book}, self._entries(dimension))
            book.counted.sort()  # a sorted list is a heap
            self._books[(dimension, partition)] = book
        return book

    async def _books_from_tables(
        self, dimension: str, partitions: set[int]
    ) -> dict[int, PartitionBook]:
        """The books of `partitions`, made from the tables after a start or a rebalance
        so entries recovered from the changelog expire like the others: one walk for
        them all, in slices, so a large table does not hold the event loop."""
        books = {partition: PartitionBook() for partition in partitions}
        if not books:
            return books
        entries = self._entries(dimension)
        for start in range(0, len(entries), REBUILD_SLICE):
            self._fill_books(dimension, books, entries[start : start + REBUILD_SLICE])
            await asyncio.sleep(0)
        for book in books.values():
            book.counted.sort()  # a sorted list is a heap
        return books

    def _entries(self, dimension: str) -> list[tuple[bool, bytes, bytes]]:
        """(is a rollup, key, value) of both tables of `dimension`, taken at once."""
        return [(True, k, v) for k, v in self._tables[dimension].items()] + [
            (False, k, v) for k, v in self._counted[dimension].items()
        ]

    def _fill_books(
        self,
        dimension: str,
        books: dict[int, PartitionBook],
        entries: list[tuple[bool, bytes, bytes]],
    ) -> None:
        for is_rollup, key, value in entries:
            if is_rollup:
                rollup = Rollup.load(orjson.loads(value))
                book = books.get(rollup.partition)
                if book is not None:
                    book.windows[key] = (rollup.end_ms, self._expiry(rollup))
                    if rollup.requests:  # not from re-runs' finals alone, as in count()
                        _advance(book, rollup.start_ms)
            elif key.startswith(SKIPPED_PREFIX):
                partition = int(key[len(SKIPPED_PREFIX) :])
                if partition in books:
                    books[partition].skipped_to = int(value)
            else:
                owner, _, at = value.decode().partition(":")
                if int(owner) in books:
                    books[int(owner)].counted.append((int(at), key))

    def _housekeep(self, dimension: str, book: PartitionBook) -> None:
        """Drop what stream time has passed (inside the stream: tables change only there).
        A window expired before its last change was published closed (a catch-up: stream
        time runs far ahead of the publish timer) stays until it is: kept in memory
        only, its final figures were lost to a rebalance or a restart."""
        if monotonic() - book.housekept_at < HOUSEKEEP_EVERY_S:
            return
        book.housekept_at = monotonic()
        counted, table = self._counted[dimension], self._tables[dimension]
        horizon = book.stream_ms - self._dedupe_ms
        while book.counted and book.counted[0][0] < horizon:
            counted.pop(heapq.heappop(book.counted)[1], None)
        for name in [n for n, (_, expiry) in book.windows.items() if expiry < book.stream_ms]:
            if name in book.dirty or name in book.sending or name not in book.closed:
                continue  # published closed first, its last change too
            table.pop(name, None)
            del book.windows[name]
            book.closed.discard(name)


def _summary(stored: bytes, closed: bool) -> bytes:
    return orjson.dumps(Rollup.load(orjson.loads(stored)).summary(closed))


def _advance(book: PartitionBook, at_ms: int) -> None:
    book.stream_ms = max(book.stream_ms, not_ahead(at_ms))


def not_ahead(at_ms: int) -> int:
    """A record's time, at most CLOCK_AHEAD_MS ahead of this clock."""
    return min(at_ms, now_ms() + CLOCK_AHEAD_MS)


def _skipped_key(partition: int) -> bytes:
    return SKIPPED_PREFIX + str(partition).encode()


def _position() -> tuple[int, int]:
    """(partition, offset) of the record being processed: tables change only inside a
    stream, on its partition (faust writes the changelog there)."""
    event = current_event()
    if event is None:
        raise RuntimeError("rollups change only while a stream processes a record")
    return event.message.partition, event.message.offset


def _table(app: faust.App, name: str) -> Any:
    return app.Table(
        name,
        default=None,
        partitions=topics.USAGE_PARTITIONS,  # co-partitioned with `usage`
        key_type=bytes,
        value_type=bytes,  # orjson, the app's raw serializer
    )
