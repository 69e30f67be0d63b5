"""Kafka losing track of a producer's sequence, as after a restart (CI saw it: every
later record to the partition was refused, the worker's final with them, the worker
stopped and its reply was lost): the producer starts over under a new producer id,
and every record reaches Kafka once, in the order it was sent."""

from __future__ import annotations

import asyncio

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from infra.topics import TopicSpec, ensure_topics
from tandoor.clients import kafka_producer
from tandoor.renewing_producer import RenewingProducer
from tandoor.settings import Settings
from tests.waiting import until


async def test_records_refused_for_their_sequence_reach_kafka_once_in_order(
    settings: Settings, unique: str
) -> None:
    topic = f"renewal-{unique}"
    await ensure_topics(settings.kafka_bootstrap, [TopicSpec(topic, 2)])
    sent: dict[int, list[bytes]] = {0: [], 1: []}
    deliveries = []

    async def send(partition: int) -> None:
        value = f"{partition}-{len(sent[partition])}".encode()
        sent[partition].append(value)
        deliveries.append(await producer.send(topic, value, partition=partition))

    async with asyncio.timeout(120), kafka_producer(settings, "renewal-test") as producer:
        for partition in (0, 1):
            await send(partition)
            await asyncio.gather(*deliveries)
        started = hold_the_fresh_producer(producer)
        lose_track_of_sequence(producer, TopicPartition(topic, 0))
        for _ in range(10):  # queued at once: one batch each, partition 0's refused
            await send(0)
            await send(1)
        await until(lambda: producer._renewal is not None, what="a renewal")
        for _ in range(5):  # sent while it starts over: held, then sent in turn
            await send(0)
            await send(1)
        started.set()
        final = f"0-{len(sent[0])}".encode()
        sent[0].append(final)
        await producer.send_and_wait(topic, final, partition=0)
        await asyncio.gather(*deliveries)

    assert producer.renewals == 1
    assert await read_back(settings, topic, 0) == sent[0]
    assert await read_back(settings, topic, 1) == sent[1]


def hold_the_fresh_producer(producer: RenewingProducer) -> asyncio.Event:
    """The fresh producer starts once the event is set: records sent until then are
    held, whatever the machine's speed."""
    started, start = asyncio.Event(), producer._started_fresh

    async def once_set() -> AIOKafkaProducer:
        await started.wait()
        return await start()

    producer._started_fresh = once_set  # type: ignore[method-assign]
    return started


def lose_track_of_sequence(producer: RenewingProducer, partition: TopicPartition) -> None:
    """The producer's next sequence number for `partition` is no longer the one Kafka
    expects, as when a restarted broker lost the producer's last batches."""
    producer._producer._txn_manager.increment_sequence_number(partition, 5)


async def read_back(settings: Settings, topic: str, partition: int) -> list[bytes]:
    """Every value on the partition, to its end (all were acknowledged)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap)
    await consumer.start()
    try:
        where = TopicPartition(topic, partition)
        consumer.assign([where])
        await consumer.seek_to_beginning(where)
        end = (await consumer.end_offsets([where]))[where]
        values: list[bytes] = []
        while await consumer.position(where) < end:
            for records in (await consumer.getmany(where, timeout_ms=1_000)).values():
                values += [record.value or b"" for record in records]
        return values
    finally:
        await consumer.stop()
