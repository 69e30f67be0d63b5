"""Everything a worker writes to Kafka: token events, final events, usage, dead letters."""

from __future__ import annotations

import asyncio

from aiokafka import AIOKafkaProducer
from aiokafka.structs import ConsumerRecord

from schemas import topics
from schemas.codec import encode
from schemas.events import Event, FinalEvent, UsageRecord


class Publisher:
    def __init__(self, producer: AIOKafkaProducer) -> None:
        self._producer = producer

    async def token(
        self, event: Event, request_id: str, reply_partition: int | None
    ) -> asyncio.Future[object]:
        """Queue a token event; ordering with the final event is kept by the idempotent
        producer, so there is no need to wait for each delivery: the caller checks the
        returned deliveries before it sends the final."""
        delivery: asyncio.Future[object] = await self._producer.send(
            topics.TOKENS, encode(event), key=request_id.encode(), partition=reply_partition
        )
        return delivery

    async def final(self, event: FinalEvent, reply_partition: int | None) -> None:
        """Deliver the final event (and so every token event before it) before returning."""
        delivery = await self._producer.send(
            topics.TOKENS, encode(event), key=event.request_id.encode(), partition=reply_partition
        )
        await delivery

    async def usage(self, record: UsageRecord) -> None:
        await self._producer.send_and_wait(
            topics.USAGE, encode(record), key=record.user_id.encode()
        )

    async def dead_letter(self, record: ConsumerRecord[bytes, bytes], reason: str) -> None:
        headers = topics.dead_letter_headers(record.topic, record.partition, record.offset, reason)
        await self._producer.send_and_wait(
            topics.DEAD_LETTER, record.value, key=record.key, headers=headers
        )
