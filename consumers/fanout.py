"""SSE fan-out: each gateway replica reads only its own share of `tokens`.

A replica is a member of the `gateway` consumer group on `tokens`. Every prompt it
publishes names one of its partitions as `reply_partition`, and the worker produces
that request's events there, so one replica sees the whole reply without reading
anybody else's traffic. A client that reconnects (to any replica) is served by a
reader of that one partition from the request's first offset. If a rebalance takes
a partition away, one reader of that partition carries the replica's open streams on
it from where they were, until each has ended or been dropped; only that reader feeds
them, even if the partition comes back. An event reaches a
subscription once, whoever reads it (offsets only go forward), and the Kafka readers
of a replica are bounded: the group member, a reader per lost partition, and one per
resumed stream (bounded by the stream slots).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import IllegalStateError, KafkaConnectionError, KafkaError
from aiokafka.structs import ConsumerRecord

from schemas import topics
from schemas.codec import SchemaError, decode_token_stream
from schemas.events import FinalEvent, TokenEvent
from tandoor.background import Background
from tandoor.lifecycle import fatal
from tandoor.settings import Settings

log = logging.getLogger(__name__)

StreamEvent = TokenEvent | FinalEvent


@dataclass(frozen=True)
class Delivered:
    """An event with where it sits in Kafka."""

    partition: int
    offset: int
    event: StreamEvent


@dataclass
class Subscription:
    request_id: str
    partition: int
    next_offset: int  # where this request's events can start, then one past the last seen
    queue: asyncio.Queue[Delivered] = field(default_factory=asyncio.Queue)

    def push(self, item: Delivered) -> None:
        """Deliver an event once, whichever reader (group member or hand-over) had it."""
        if item.offset < self.next_offset:
            return
        self.next_offset = item.offset + 1
        self.queue.put_nowait(item)


class ReaderCount:
    """Kafka consumers this process has open for token events (a metric)."""

    open = 0


HANDOVER_POLL_MS = 1000  # how soon a hand-over reader sees its last stream gone
DISPATCH_POLL_MS = 1000  # an empty poll's length: records end it as they arrive
READER_RETRY_S = 1.0  # a reader failing (Kafka unreachable): again after this


class NotRouting(KafkaError):  # type: ignore[misc]
    """The fan-out owns no tokens partition (a rebalance under way): Kafka's to settle."""


class TokenFanout(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=settings.kafka_bootstrap,
            group_id=settings.gateway_group,
            client_id="gateway",
            enable_auto_commit=False,  # positions start at the end: replays go by event id
            auto_offset_reset="latest",
            fetch_max_wait_ms=settings.fetch_wait_ms,
        )
        self._subs: dict[str, Subscription] = {}
        self._usable: list[int] = []
        self._next = itertools.count()
        self._ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._handovers = Background()  # a reader per partition lost with open streams
        # Streams a hand-over reader carries: only it feeds them. Given their partition
        # back (an eager rebalance revokes all), the group member starts at the end, and
        # an event it passed on first would make the hand-over's earlier ones look old
        # (dropped): a gap, which holds the client's text back until the final.
        self._carried: Counter[str] = Counter()
        self.failure: BaseException | None = None  # the dispatch task died of it

    async def start(self, timeout_s: float = 30) -> None:
        self._consumer.subscribe([topics.TOKENS], listener=self)
        await self._consumer.start()
        ReaderCount.open += 1
        self._task = asyncio.create_task(self._dispatch(), name="token-fanout")
        self._task.add_done_callback(self._dispatch_ended)
        await asyncio.wait_for(self._ready.wait(), timeout_s)

    async def stop(self) -> None:
        await self._handovers.cancel()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._task = None
        await self._consumer.stop()
        ReaderCount.open -= 1

    @property
    def ready(self) -> bool:
        """Owns tokens partitions, so replies can be routed to this replica."""
        return self._ready.is_set() and self.failure is None

    @property
    def handovers(self) -> int:
        return len(self._handovers)

    def _dispatch_ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        self.failure = task.exception() or RuntimeError("token fan-out ended")
        log.error("token fan-out stopped: %r; this replica can route no reply", self.failure)
        fatal(self.failure)

    @property
    def following(self) -> int:
        return len(self._subs)

    async def subscribe(self, request_id: str) -> Subscription:
        """Register before the prompt is produced, so no event can slip past. NotRouting
        while this replica owns no tokens partition past kafka_send_timeout_s (its group
        re-forming): each post waited, headerless and holding its stream slot."""
        try:
            async with asyncio.timeout(self.settings.kafka_send_timeout_s):
                await self._ready.wait()
        except TimeoutError:
            raise NotRouting("replies cannot be routed to this replica right now") from None
        try:
            partition = self._usable[next(self._next) % len(self._usable)]
            position = await self._consumer.position(TopicPartition(topics.TOKENS, partition))
        except (IllegalStateError, ZeroDivisionError):  # revoked meanwhile: a rebalance's
            raise NotRouting("replies cannot be routed to this replica right now") from None
        sub = Subscription(request_id, partition, position)
        self._subs[request_id] = sub
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        """Only `sub` itself: a later subscription to the same id (a job's, whose ids
        are made from what it covers) was removed by the earlier one's end."""
        if self._subs.get(sub.request_id) is sub:
            del self._subs[sub.request_id]

    # ConsumerRebalanceListener
    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        for tp in assigned:  # resolve "latest" now: a later event must not be skipped
            await self._consumer.position(tp)
        self._usable = sorted(tp.partition for tp in assigned if tp.topic == topics.TOKENS)
        log.info("gateway reads tokens partitions %s", self._usable)
        if self._usable:
            self._ready.set()

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        lost = {tp.partition for tp in revoked}
        self._usable = [p for p in self._usable if p not in lost]
        if not self._usable:
            self._ready.clear()
        for partition in lost:
            # Not those a reader carries already: each rebalance revokes everything.
            subs = [
                s
                for s in self._subs.values()
                if s.partition == partition and s.request_id not in self._carried
            ]
            if subs:
                self._carried.update(sub.request_id for sub in subs)
                self._handovers.start(self._hand_over(partition, subs))

    async def _hand_over(self, partition: int, subs: list[Subscription]) -> None:
        """Keep the open streams of a lost partition going with one reader, until each
        has ended (its final) or was dropped (its client's reply watch gave up). A
        reader that fails (Kafka unreachable: often what moved the partition; or
        anything else) is started again from where each stream is: its streams have no
        other reader."""
        waiting = {sub.request_id: sub for sub in subs}
        try:
            while waiting:
                try:
                    await self._read_handed_over(partition, waiting)
                except Exception as exc:  # its streams have no other reader
                    log.warning(
                        "reading tokens partition %d for %d moved streams failed (%r); "
                        "again in %.0f s",
                        partition,
                        len(waiting),
                        exc,
                        READER_RETRY_S,
                        exc_info=not isinstance(exc, KafkaError),  # a bug's traceback
                    )
                    await asyncio.sleep(READER_RETRY_S)
                    waiting = self._still_followed(waiting)
        finally:
            self._carried.subtract(sub.request_id for sub in subs)
            self._carried = +self._carried  # drops the zeros

    async def _read_handed_over(self, partition: int, waiting: dict[str, Subscription]) -> None:
        """Feed `waiting` (emptied as each stream ends) from their partition."""
        start = min(sub.next_offset for sub in waiting.values())
        async with partition_reader(self.settings, partition, start) as consumer:
            while waiting:
                batch = await consumer.getmany(timeout_ms=HANDOVER_POLL_MS)
                for record in [r for records in batch.values() for r in records]:
                    sub = waiting.get(_request_id(record))
                    if sub is not None and (item := _delivered(record)) is not None:
                        sub.push(item)
                        if isinstance(item.event, FinalEvent):
                            del waiting[sub.request_id]
                for request_id in set(waiting) - set(self._still_followed(waiting)):
                    del waiting[request_id]

    def _still_followed(self, waiting: dict[str, Subscription]) -> dict[str, Subscription]:
        return {k: s for k, s in waiting.items() if self._subs.get(k) is s}

    async def _dispatch(self) -> None:
        while True:  # a fetch's records at once: one at a time cost a fifth of the loop
            batch = await self._consumer.getmany(timeout_ms=DISPATCH_POLL_MS)
            for records in batch.values():
                for record in records:
                    self._route(record)

    def _route(self, record: ConsumerRecord[bytes, bytes]) -> None:
        sub = self._subs.get(_request_id(record))
        if sub is None or sub.partition != record.partition:
            return
        if sub.request_id in self._carried:
            return
        item = _delivered(record)
        if item is not None:
            sub.push(item)


READER_FETCH_BYTES = 256 * 1024  # aiokafka's default: 1 MiB a stream, 1 GiB at 1,000


@contextlib.asynccontextmanager
async def partition_reader(
    settings: Settings, partition: int, offset: int
) -> AsyncIterator[AIOKafkaConsumer]:
    """A consumer of one tokens partition from `offset`, outside any group. It holds at
    most one fetch of the partition, most of it other replies' events: small, as every
    resumed stream has one (after a replica drains, all of its streams at once)."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.kafka_bootstrap,
        group_id=None,
        enable_auto_commit=False,
        fetch_max_wait_ms=settings.fetch_wait_ms,
        max_partition_fetch_bytes=READER_FETCH_BYTES,
        fetch_max_bytes=READER_FETCH_BYTES,
    )
    ReaderCount.open += 1  # from its start until it has stopped: the metric shows leaks
    try:
        await consumer.start()  # within: one cancelled meanwhile (its client left) stops too
        tp = TopicPartition(topics.TOKENS, partition)
        consumer.assign([tp])
        consumer.seek(tp, offset)
        yield consumer
    finally:
        # Stopped in a task of its own: Starlette cancels a stream whose client left
        # again and again, and a second cancel cut the stop short (fetcher and
        # connections left running, the metric counting the reader closed).
        await asyncio.shield(_STOPPING.start(_stop_reader(consumer)))


_STOPPING = Background()  # a reader's stop, kept referenced however its caller ends


async def _stop_reader(consumer: AIOKafkaConsumer) -> None:
    try:
        with contextlib.suppress(Exception):
            await consumer.stop()
    finally:
        ReaderCount.open -= 1


async def read_request(
    settings: Settings, request_id: str, partition: int, offset: int
) -> AsyncGenerator[Delivered, None]:
    """One request's events from one partition, from `offset` until its final event.
    Kafka unreachable: tried again, from past the last event read, for as long as the
    caller waits (a resumed stream keeps its client with keep-alives until its silence
    limit); the error ended the stream with a traceback, its start frame sent."""
    while True:
        try:
            async with partition_reader(settings, partition, offset) as consumer:
                async for record in consumer:
                    if record.key != request_id.encode():
                        continue
                    item = _delivered(record)
                    if item is None:
                        continue
                    offset = item.offset + 1
                    yield item
                    if isinstance(item.event, FinalEvent):
                        return
        except KafkaConnectionError as exc:
            log.warning(
                "%s: events unreadable (%s), again in %.0f s", request_id, exc, READER_RETRY_S
            )
            await asyncio.sleep(READER_RETRY_S)


def _request_id(record: ConsumerRecord[bytes, bytes]) -> str:
    """The key's request id; one that is not UTF-8 (another client's record) matches no
    stream, and is passed over instead of stopping the reader."""
    return record.key.decode(errors="replace") if record.key else ""


def _delivered(record: ConsumerRecord[bytes, bytes]) -> Delivered | None:
    try:
        return Delivered(record.partition, record.offset, decode_token_stream(record.value))
    except SchemaError as exc:
        log.error("undecodable event at tokens %s@%s: %s", record.partition, record.offset, exc)
        return None
