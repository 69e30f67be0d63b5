"""How many prompts reached a model's topic: what a refusal must leave unchanged."""

from __future__ import annotations

from aiokafka import AIOKafkaConsumer, TopicPartition

from schemas.topics import BandLayout, prompts_topic
from tandoor.settings import Settings


async def queued(settings: Settings, model: str, band: str | None = None) -> int:
    """How many prompts were ever produced to the model's topic (to `band`'s partitions,
    if given)."""
    layout = BandLayout([(b.name, b.partitions) for b in settings.bands])
    ranges = layout.ranges if band is None else [layout.band(band)]
    tps = [TopicPartition(prompts_topic(model), p) for r in ranges for p in r.partitions]
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap)
    await consumer.start()
    try:
        return sum((await consumer.end_offsets(tps)).values())
    finally:
        await consumer.stop()
