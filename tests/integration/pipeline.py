"""Test helpers: prompts for the real pipeline, where a worker group has committed, and
knowing that nothing more is on its way."""

from __future__ import annotations

import uuid

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from consumers.token_reader import TokenCollector
from schemas import topics
from schemas.codec import encode
from schemas.events import ChatMessage, PromptRequest, Sampling, TokenEvent, now_ms
from tandoor.settings import Settings
from tests.waiting import eventually


def prompt(
    model: str,
    text: str,
    *,
    band: str = "interactive-paid",
    max_tokens: int = 32,
    deadline_ms: int | None = None,
    conversation_id: str | None = None,
    ignore_eos: bool = False,
) -> PromptRequest:
    return PromptRequest(
        request_id=f"req-{uuid.uuid4().hex[:12]}",
        model=model,
        user_id="tester",
        tier="plus",
        band=band,
        conversation_id=conversation_id or f"conv-{uuid.uuid4().hex[:8]}",
        messages=[ChatMessage(role="user", content=text)],
        # ignore_eos: a reply that must still be running later, whatever the hardware.
        sampling=Sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos),
        created_at_ms=now_ms(),
        deadline_ms=deadline_ms,
    )


async def committed_offset(settings: Settings, model: str, partition: int) -> int | None:
    """Where the workers of `model` will resume in `partition`."""
    tp = TopicPartition(topics.prompts_topic(model), partition)
    return await group_committed(settings, topics.worker_group(model), tp)


async def group_committed(settings: Settings, group: str, tp: TopicPartition) -> int | None:
    """Where `group` will resume in `tp` (None: it never committed there)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap, group_id=group)
    await consumer.start()
    try:
        offset = await consumer.committed(tp)
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


async def caught_up(stream: TokenCollector, producer: AIOKafkaProducer, settings: Settings) -> None:
    """Until `stream` has read everything published to `tokens` before this call: a
    sentinel goes to every partition (Kafka keeps each partition's order)."""
    marker = f"sentinel-{uuid.uuid4().hex[:8]}"
    partitions = settings.tokens_partitions
    for partition in range(partitions):
        event = TokenEvent(
            request_id=marker,
            attempt=1,
            seq=partition,
            delta="",
            token_count=0,
            created_at_ms=now_ms(),
        )
        await producer.send_and_wait(topics.TOKENS, encode(event), partition=partition)
    await stream.wait_for(lambda: len(stream.events[marker]) == partitions, marker)


async def all_committed(settings: Settings, model: str) -> None:
    """Until the workers of `model` have committed every prompt queued so far: each
    one's final was published before its commit."""
    partitions = sum(band.partitions for band in settings.bands)

    async def behind() -> list[int]:
        return [
            await end_offset(settings, model, p) - (await committed_offset(settings, model, p) or 0)
            for p in range(partitions)
        ]

    await eventually(behind, lambda lag: not any(lag), what=f"{model} prompts committed")
