"""Reading a topic that outside producers write to, past records aiokafka cannot parse.

aiokafka decodes each header name as UTF-8 while it iterates a fetched batch. A record
whose header name is not UTF-8 (the broker accepts it) makes `getmany` raise; the
records it had drained from other partitions in that call are lost, and the bad record
is fetched again at the next call, so one hostile producer stops the consumer for good,
again after every restart. Reading one partition per call keeps the others' records
apart, and the unreadable record is found and stepped over."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeAlias

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError
from aiokafka.structs import ConsumerRecord

log = logging.getLogger(__name__)

Record: TypeAlias = ConsumerRecord[bytes, bytes]
OnUnreadable = Callable[[TopicPartition, int, str], Awaitable[None]]
UNREADABLE = (UnicodeDecodeError,)  # what aiokafka's record parser raises on a bad header
STEP_WAIT_MS = 1000  # per record while stepping towards the unreadable one


class PartitionReader:
    """`getmany` one partition at a time; an unreadable record is reported and skipped."""

    def __init__(self, consumer: AIOKafkaConsumer, on_unreadable: OnUnreadable) -> None:
        self._consumer = consumer
        self._on_unreadable = on_unreadable
        self._turn = 0  # which partition is read first: each in turn

    async def read(self, *, max_records: int, idle_s: float) -> list[Record]:
        """What has arrived on the assigned, unpaused partitions; waits idle_s if nothing."""
        records: list[Record] = []
        try:
            for tp in self._in_turn():
                if len(records) >= max_records:
                    break
                records += await self._read_partition(tp, max_records - len(records))
        except BaseException:
            self._rewind(records)
            raise
        if not records:
            await asyncio.sleep(idle_s)
        return records

    def _in_turn(self) -> list[TopicPartition]:
        """The readable partitions, starting from the next in turn: read from the lowest
        first, a flood on it (lines answered as read, never paused) starved the rest."""
        readable = self._consumer.assignment() - self._consumer.paused()
        ordered = sorted(readable, key=lambda tp: tp.partition)
        if not ordered:
            return []
        first = self._turn % len(ordered)
        self._turn += 1
        return ordered[first:] + ordered[:first]

    async def _read_partition(self, tp: TopicPartition, max_records: int) -> list[Record]:
        try:
            fetched = await self._consumer.getmany(tp, timeout_ms=0, max_records=max_records)
        except UNREADABLE:
            return await self._step_over_unreadable(tp)
        return list(fetched.get(tp, []))

    async def _step_over_unreadable(self, tp: TopicPartition) -> list[Record]:
        """Read the partition a record at a time (fetched again from the consumer's
        position) up to the one that raises, then seek past it. The readable records
        before it are returned: none is lost."""
        readable: list[Record] = []
        while True:
            try:
                fetched = await self._consumer.getmany(tp, timeout_ms=STEP_WAIT_MS, max_records=1)
            except UNREADABLE as exc:
                await self._skip(tp, exc)
                return readable
            except BaseException:
                self._rewind(readable)
                raise
            if not fetched.get(tp):
                return readable  # it moved on (a rebalance) or is slow: the next read retries
            readable += fetched[tp]

    async def _skip(self, tp: TopicPartition, exc: Exception) -> None:
        """Seek past the record at the position, unless the partition was revoked
        meanwhile (its new owner finds the record and skips it)."""
        if tp not in self._consumer.assignment():
            return
        offset = await self._consumer.position(tp)
        if tp not in self._consumer.assignment():
            return
        self._consumer.seek(tp, offset + 1)
        log.warning("skipping unreadable record %s/%s@%s: %s", *tp, offset, exc)
        await self._on_unreadable(tp, offset, str(exc))  # must not raise

    async def unread(self, records: list[Record]) -> None:
        """Records read but not taken (a rebalance meanwhile) are read again: from the
        first of them (or the commit, if later), on each partition still assigned whose
        position is past it. A position reset to the commit by the new assignment reads
        them again already (seeking forward then would skip the lines before them)."""
        for tp, offset in _first_offsets(records).items():
            if tp not in self._consumer.assignment():
                continue  # its new owner reads it from the commit
            try:
                # Not before the commit: back after another member had it, what that
                # member committed is handled (marks stop a line running twice, not an
                # unmarked refusal being answered twice).
                start = max(offset, await self._consumer.committed(tp) or 0)
                past = await self._consumer.position(tp) > start
            except KafkaError as exc:  # moved again while its position was fetched
                log.info("not reading %s/%s again from %s: %r", *tp, offset, exc)
                continue
            if past and tp in self._consumer.assignment():  # not revoked while asked
                self._consumer.seek(tp, start)

    def _rewind(self, records: list[Record]) -> None:
        """Records read but not handed out (the call failed after them) are read again."""
        for tp, offset in _first_offsets(records).items():
            if tp in self._consumer.assignment():
                self._consumer.seek(tp, offset)


def _first_offsets(records: list[Record]) -> dict[TopicPartition, int]:
    first: dict[TopicPartition, int] = {}
    for record in records:
        tp = TopicPartition(record.topic, record.partition)
        first[tp] = min(first.get(tp, record.offset), record.offset)
    return first
