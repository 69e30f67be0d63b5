"""Test helpers: prompts for the real pipeline, and where a worker group has committed."""

from __future__ import annotations

import uuid

from aiokafka import AIOKafkaConsumer, TopicPartition

from schemas import topics
from schemas.events import ChatMessage, PromptRequest, Sampling, now_ms
from tandoor.settings import Settings


def prompt(
    model: str,
    text: str,
    *,
    band: str = "interactive-paid",
    max_tokens: int = 32,
    deadline_ms: int | None = None,
    conversation_id: str | None = None,
) -> PromptRequest:
    return PromptRequest(
        request_id=f"req-{uuid.uuid4().hex[:12]}",
        model=model,
        user_id="tester",
        tier="plus",
        band=band,
        conversation_id=conversation_id or f"conv-{uuid.uuid4().hex[:8]}",
        messages=[ChatMessage(role="user", content=text)],
        sampling=Sampling(max_tokens=max_tokens, temperature=0.0),
        created_at_ms=now_ms(),
        deadline_ms=deadline_ms,
    )


async def committed_offset(settings: Settings, model: str, partition: int) -> int | None:
    """Where the workers of `model` will resume in `partition`."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.kafka_bootstrap, group_id=topics.worker_group(model)
    )
    await consumer.start()
    try:
        offset = await consumer.committed(TopicPartition(topics.prompts_topic(model), partition))
        return None if offset is None else int(offset)
    finally:
        await consumer.stop()


async def end_offset(settings: Settings, model: str, partition: int) -> int:
    """One past the newest prompt in `partition`."""
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap)
    await consumer.start()
    try:
        tp = TopicPartition(topics.prompts_topic(model), partition)
        return int((await consumer.end_offsets([tp]))[tp])
    finally:
        await consumer.stop()
