"""An idempotent Kafka producer that starts over under a new producer id when Kafka
stops taking its sequence numbers, and sends again, in order, what was refused.

Kafka restarted (or a partition's leader moved) can lose track of a producer's last
sequence number; it then answers each later record to that partition with
OutOfOrderSequenceNumber. aiokafka never recovers (aio-libs/aiokafka#1017): the
worker's final event failed, the worker stopped, and the reply it was writing was lost.
The Java client bumps its epoch and sends the refused batches again; this does the
same with a fresh producer: the records refused, then those sent meanwhile, go out
again in the order they were first sent, and each caller's future gets the result.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import (
    InvalidProducerEpoch,
    KafkaError,
    OutOfOrderSequenceNumber,
    ProducerClosed,
    ProducerFenced,
    UnknownProducerId,
)

log = logging.getLogger(__name__)
# Kafka no longer knows where this producer's sequence is: only a new producer id helps.
OUT_OF_STEP = (OutOfOrderSequenceNumber, UnknownProducerId, InvalidProducerEpoch, ProducerFenced)
MAX_RESENDS = 3  # a record refused again after as many fresh producers fails for good
START_AGAIN_S = (0.5, 1.0, 2.0, 5.0)  # between tries to start the fresh producer
STOP_OLD_S = 10.0  # the refused producer's last batches, at most


@dataclass(eq=False)
class _Record:
    number: int  # the order it was sent in
    topic: str
    args: dict[str, Any]
    outcome: asyncio.Future[Any]
    resends: int = 0


@dataclass
class _Renewal:
    broken: AIOKafkaProducer  # the producer being replaced
    queue: list[tuple[int, _Record]] = field(default_factory=list)  # refused and held, a heap
    again: bool = False  # the fresh producer was refused too: another one takes over

    def put(self, record: _Record) -> None:
        heapq.heappush(self.queue, (record.number, record))


class RenewingProducer:
    """The part of AIOKafkaProducer the roles use: send, send_and_wait, partitions_for,
    client, flush, start, stop, and `async with`. As with aiokafka, a record whose
    caller stopped waiting once it was queued may still be sent."""

    def __init__(self, make: Callable[[], AIOKafkaProducer]) -> None:
        self._make = make
        self._producer = make()
        self._numbers = itertools.count()
        self._in_flight: dict[AIOKafkaProducer, set[_Record]] = {}
        self._landing = asyncio.Event()  # set as each record lands: drains wait on it
        self._renewal: _Renewal | None = None
        self._renewing: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = False
        self.renewals = 0

    @property
    def client(self) -> Any:
        return self._producer.client

    async def partitions_for(self, topic: str) -> set[int]:
        partitions: set[int] = await self._producer.partitions_for(topic)
        return partitions

    async def start(self) -> None:
        await self._producer.start()

    async def stop(self) -> None:
        """Flush and stop; a renewal under way gives up, and what it held fails."""
        self._stopping = True
        if self._renewing is not None and not self._renewing.done():
            self._renewing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewing
        renewal, self._renewal = self._renewal, None
        if renewal is not None and renewal.broken is not self._producer:
            await _stop_within(renewal.broken, STOP_OLD_S)
        await self._producer.stop()
        held = [record for _, record in renewal.queue] if renewal else []
        for record in self._unanswered() + held:
            _resolve(record.outcome, error=ProducerClosed())
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, KafkaError, TimeoutError):
                await task

    async def flush(self) -> None:
        """Until every record sent so far has its answer, those sent again included."""
        while unanswered := [r.outcome for r in self._unanswered() if not r.outcome.done()]:
            await asyncio.wait(unanswered)

    def _unanswered(self) -> list[_Record]:
        records = [record for flying in self._in_flight.values() for record in flying]
        return records + ([r for _, r in self._renewal.queue] if self._renewal else [])

    async def __aenter__(self) -> RenewingProducer:
        await self.start()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def send(
        self,
        topic: str,
        value: bytes | None = None,
        key: bytes | None = None,
        partition: int | None = None,
        *,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> asyncio.Future[Any]:
        """Queue a record: the future gets its metadata once Kafka has it."""
        if self._stopping:
            raise ProducerClosed()
        args = {"value": value, "key": key, "partition": partition, "headers": headers}
        outcome = asyncio.get_running_loop().create_future()
        record = _Record(next(self._numbers), topic, args, outcome)
        if self._renewal is not None:
            self._producer._serialize(key, value, headers or [])  # too large: raised now
            self._renewal.put(record)
        else:
            await self._submit(record, self._producer)
        return record.outcome

    async def send_and_wait(
        self,
        topic: str,
        value: bytes | None = None,
        key: bytes | None = None,
        partition: int | None = None,
        *,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> Any:
        """send, then its answer; positional arguments in aiokafka's order."""
        return await (await self.send(topic, value, key, partition, headers=headers))

    async def _submit(self, record: _Record, producer: AIOKafkaProducer) -> None:
        # In flight from here: a renewal waits for it even while aiokafka waits for room.
        self._in_flight.setdefault(producer, set()).add(record)
        try:
            delivery = await producer.send(record.topic, **record.args)
        except BaseException:  # never queued: too large, no metadata, cancelled
            self._landed(record, producer)
            raise
        delivery.add_done_callback(lambda done: self._settled(record, producer, done))

    async def _resubmit(self, record: _Record, producer: AIOKafkaProducer) -> None:
        """_submit for a record whose caller has its future already."""
        try:
            await self._submit(record, producer)
        except Exception as exc:
            _resolve(record.outcome, error=exc)
        except BaseException:
            _resolve(record.outcome, error=ProducerClosed())
            raise

    def _settled(
        self, record: _Record, producer: AIOKafkaProducer, done: asyncio.Future[Any]
    ) -> None:
        error = None if done.cancelled() else done.exception()
        if isinstance(error, OUT_OF_STEP) and record.resends < MAX_RESENDS:
            self._refused(record, producer, error)
        elif done.cancelled():
            record.outcome.cancel()
        else:
            _resolve(record.outcome, None if error else done.result(), error)
        self._landed(record, producer)

    def _landed(self, record: _Record, producer: AIOKafkaProducer) -> None:
        self._in_flight.get(producer, set()).discard(record)
        self._landing.set()

    def _refused(self, record: _Record, producer: AIOKafkaProducer, error: BaseException) -> None:
        if self._stopping:
            _resolve(record.outcome, error=ProducerClosed())
            return
        record.resends += 1
        renewal = self._renewal
        if renewal is None:  # the current producer is replaced (others have nothing left)
            renewal = self._renewal = _Renewal(self._producer)
            log.warning("Kafka refused this producer's sequence (%r): starting over", error)
            self._renewing = asyncio.create_task(self._renew(renewal))
        elif producer is self._producer and producer is not renewal.broken:
            renewal.broken, renewal.again = producer, True  # the fresh one, refused as well
        renewal.put(record)

    async def _renew(self, renewal: _Renewal) -> None:
        """Once the refused producer has no record in flight (the rest of its refusals
        come back meanwhile), a fresh one sends the refused and held records in the
        order they were first sent; sends go straight to it from then on. The fresh
        one refused meanwhile (`again`) is replaced in turn."""
        try:
            while renewal.broken is self._producer:
                await self._drained(renewal.broken)
                fresh = await self._started_fresh()
                broken, self._producer, renewal.again = self._producer, fresh, False
                self._in_flight.pop(broken, None)
                self._in_background(_stop_within(broken, STOP_OLD_S))
                while renewal.queue and not renewal.again:
                    await self._resubmit(heapq.heappop(renewal.queue)[1], fresh)
                self.renewals += 1
                log.warning("a fresh producer took over (%d renewals so far)", self.renewals)
        except Exception as exc:  # not seen; were it to happen, no send may wait for good
            log.exception("renewing the producer failed; what it held fails")
            for _, record in renewal.queue:
                _resolve(record.outcome, error=exc)
        self._renewal = None

    async def _drained(self, producer: AIOKafkaProducer) -> None:
        while self._in_flight.get(producer):
            self._landing.clear()
            await self._landing.wait()

    async def _started_fresh(self) -> AIOKafkaProducer:
        for attempt in itertools.count():
            fresh = self._make()
            try:
                await fresh.start()
                return fresh
            except KafkaError as exc:  # Kafka away still: the held records wait for it
                await _stop_within(fresh, STOP_OLD_S)
                wait_s = START_AGAIN_S[min(attempt, len(START_AGAIN_S) - 1)]
                log.warning("fresh producer not started (%r); again in %.1f s", exc, wait_s)
                await asyncio.sleep(wait_s)
            except BaseException:  # stopped meanwhile
                await _stop_within(fresh, STOP_OLD_S)
                raise
        raise AssertionError("unreachable")

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _resolve(
    outcome: asyncio.Future[Any], result: Any = None, error: BaseException | None = None
) -> None:
    if outcome.done():  # its caller stopped waiting
        return
    if error is not None:
        outcome.set_exception(error)
    else:
        outcome.set_result(result)


async def _stop_within(producer: AIOKafkaProducer, seconds: float) -> None:
    with contextlib.suppress(KafkaError, TimeoutError):
        await asyncio.wait_for(producer.stop(), seconds)
