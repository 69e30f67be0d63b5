"""RenewingProducer's bookkeeping around a renewal, with stand-in producers: a send
given up while aiokafka waited for room, a stop while Kafka is away, the fresh
producer refused as well. (Real Kafka: tests/integration/test_producer_renewal.py.)"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka.errors import KafkaConnectionError, OutOfOrderSequenceNumber, ProducerClosed

from tandoor import renewing_producer
from tandoor.renewing_producer import RenewingProducer
from tests.waiting import until


class Broker:
    """Kafka's side: what it took, in order, and which producers it refuses."""

    def __init__(self) -> None:
        self.log: list[bytes] = []
        self.made: list[StandIn] = []
        self.refuse: dict[int, int] = {}  # producer number -> records refused (-1: every one)
        self.down = False
        self.refused_starts = 0

    def make(self) -> Any:
        producer = StandIn(self, len(self.made))
        self.made.append(producer)
        return producer


class StandIn:
    def __init__(self, broker: Broker, number: int) -> None:
        self.broker, self.number = broker, number
        self.room = asyncio.Event()  # aiokafka's send waits for room in the batch
        self.room.set()
        self.started = self.stopped = False
        self.received: list[bytes] = []

    async def start(self) -> None:
        if self.broker.down:
            self.broker.refused_starts += 1
            raise KafkaConnectionError("Kafka is away")
        self.started = True

    async def stop(self) -> None:
        self.stopped = True

    async def send(self, topic: str, value: bytes | None = None, **_: Any) -> asyncio.Future[Any]:
        await self.room.wait()
        await asyncio.sleep(0)  # as aiokafka's send may: for metadata, for room
        self.received.append(value or b"")
        delivery = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(self._answer, delivery, value or b"")
        return delivery

    def _serialize(self, key: bytes | None, value: bytes | None, headers: Any) -> Any:
        return key, value  # aiokafka's size check: every record here is small

    def _answer(self, delivery: asyncio.Future[Any], value: bytes) -> None:
        left = self.broker.refuse.get(self.number, 0)
        if left != 0:
            self.broker.refuse[self.number] = left - 1
            delivery.set_exception(OutOfOrderSequenceNumber())
        else:
            self.broker.log.append(value)
            delivery.set_result(value)


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(renewing_producer, "START_AGAIN_S", (0.01,))


async def test_a_send_given_up_while_waiting_for_room_does_not_stall_the_next_renewal() -> None:
    broker = Broker()
    producer = RenewingProducer(broker.make)
    await producer.start()
    broker.made[0].room.clear()
    with pytest.raises(TimeoutError):  # the gateway gives up on a prompt after a while
        await asyncio.wait_for(producer.send("t", b"given up"), 0.05)
    broker.made[0].room.set()
    broker.refuse[0] = -1
    async with asyncio.timeout(5):
        assert await producer.send_and_wait("t", b"next") == b"next"
    assert broker.log == [b"next"] and producer.renewals == 1
    await producer.stop()


async def test_the_fresh_producer_refused_too_is_replaced_and_the_order_kept() -> None:
    broker = Broker()
    producer = RenewingProducer(broker.make)
    await producer.start()
    broker.refuse[0] = broker.refuse[1] = -1  # the first fresh one out of step as well
    async with asyncio.timeout(5):
        sent = [await producer.send("t", f"r{i}".encode()) for i in range(4)]
        await asyncio.gather(*sent)
    assert broker.log == [b"r0", b"r1", b"r2", b"r3"]
    assert len(broker.made) == 3 and producer.renewals == 2
    for made in broker.made:  # each record once to each producer: none sent again on one
        assert sorted(made.received) == sorted(set(made.received)), made.received
    await producer.stop()
    assert all(made.stopped for made in broker.made)


async def test_a_stop_while_kafka_is_away_fails_what_was_held_and_starts_nothing_after() -> None:
    broker = Broker()
    producer = RenewingProducer(broker.make)
    await producer.start()
    broker.refuse[0], broker.down = -1, True
    sent = [await producer.send("t", f"r{i}".encode()) for i in range(3)]
    async with asyncio.timeout(5):
        await until(lambda: broker.refused_starts, what="a fresh producer tried, in vain")
        await producer.stop()
        results = await asyncio.gather(*sent, return_exceptions=True)
    assert all(isinstance(result, ProducerClosed) for result in results), results
    # stop() has awaited the renewal's end: nothing is left to start another producer.
    assert producer._renewing is not None and producer._renewing.done()
    assert all(p.stopped for p in broker.made)
    assert broker.log == []
    with pytest.raises(ProducerClosed):
        await producer.send("t", b"after the stop")
