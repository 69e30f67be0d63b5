"""SSE fan-out: each gateway replica reads only its own share of `tokens`.

A replica is a member of the `gateway` consumer group on `tokens`. Every prompt it
publishes names one of its partitions as `reply_partition`, and the worker produces
that request's events there, so one replica sees the whole reply without reading
anybody else's traffic. A client that reconnects (to any replica) is served by a
reader of that one partition from the request's first offset. If a rebalance takes
a partition away, the replica hands its open streams on that partition to such
readers from where they were.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.structs import ConsumerRecord

from schemas import topics
from schemas.codec import SchemaError, decode_token_stream
from schemas.events import FinalEvent, TokenEvent
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
        self.next_offset = item.offset + 1
        self.queue.put_nowait(item)


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
        self._handovers: set[asyncio.Task[None]] = set()

    async def start(self, timeout_s: float = 30) -> None:
        self._consumer.subscribe([topics.TOKENS], listener=self)
        await self._consumer.start()
        self._task = asyncio.create_task(self._dispatch(), name="token-fanout")
        await asyncio.wait_for(self._ready.wait(), timeout_s)

    async def stop(self) -> None:
        for task in [*self._handovers, *([self._task] if self._task else [])]:
            task.cancel()
        await asyncio.gather(
            *self._handovers, *([self._task] if self._task else []), return_exceptions=True
        )
        self._task = None
        await self._consumer.stop()

    @property
    def ready(self) -> bool:
        """Owns tokens partitions, so replies can be routed to this replica."""
        return self._ready.is_set()

    @property
    def following(self) -> int:
        return len(self._subs)

    async def subscribe(self, request_id: str) -> Subscription:
        """Register before the prompt is produced, so no event can slip past."""
        await self._ready.wait()
        partition = self._usable[next(self._next) % len(self._usable)]
        position = await self._consumer.position(TopicPartition(topics.TOKENS, partition))
        sub = Subscription(request_id, partition, position)
        self._subs[request_id] = sub
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self._subs.pop(sub.request_id, None)

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
        for sub in [s for s in self._subs.values() if s.partition in lost]:
            task = asyncio.create_task(self._hand_over(sub))
            self._handovers.add(task)
            task.add_done_callback(self._handovers.discard)

    async def _hand_over(self, sub: Subscription) -> None:
        """Keep an open stream going from its own partition after a rebalance."""
        async for item in read_request(
            self.settings, sub.request_id, sub.partition, sub.next_offset
        ):
            if self._subs.get(sub.request_id) is not sub:
                return
            sub.push(item)

    async def _dispatch(self) -> None:
        async for record in self._consumer:
            sub = self._subs.get(record.key.decode()) if record.key else None
            if sub is None or sub.partition != record.partition:
                continue
            item = _delivered(record)
            if item is not None:
                sub.push(item)


async def read_request(
    settings: Settings, request_id: str, partition: int, offset: int
) -> AsyncIterator[Delivered]:
    """One request's events from one partition, from `offset` until its final event."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.kafka_bootstrap,
        group_id=None,
        enable_auto_commit=False,
        fetch_max_wait_ms=settings.fetch_wait_ms,
    )
    await consumer.start()
    try:
        tp = TopicPartition(topics.TOKENS, partition)
        consumer.assign([tp])
        consumer.seek(tp, offset)
        async for record in consumer:
            if record.key != request_id.encode():
                continue
            item = _delivered(record)
            if item is None:
                continue
            yield item
            if isinstance(item.event, FinalEvent):
                return
    finally:
        with contextlib.suppress(Exception):
            await consumer.stop()


def _delivered(record: ConsumerRecord[bytes, bytes]) -> Delivered | None:
    try:
        return Delivered(record.partition, record.offset, decode_token_stream(record.value))
    except SchemaError as exc:
        log.error("undecodable event at tokens %s@%s: %s", record.partition, record.offset, exc)
        return None
