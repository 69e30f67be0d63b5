"""Kafka is real: topics are bootstrapped idempotently, and a consumer group's
committed offset survives a consumer restart."""

from __future__ import annotations

import logging

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from infra.topics import TopicSpec, declared_topics, ensure_topics, partition_counts
from producers.prompts import PromptSubmitter
from schemas import topics
from schemas.codec import decode, encode
from schemas.events import ChatMessage, ControlEvent, PromptRequest, Sampling, now_ms
from schemas.topics import BandLayout
from tandoor.settings import Settings


async def test_bootstrap_twice_changes_nothing_and_sizes_bands(
    kafka: str, settings: Settings, unique: str
) -> None:
    local = settings.model_copy(update={"models": [f"model-{unique}"]})
    specs = [s for s in declared_topics(local) if s.name.startswith(topics.PROMPTS_PREFIX)]
    first = await ensure_topics(kafka, specs)
    second = await ensure_topics(kafka, specs)
    assert first.created == [f"prompts.model-{unique}"]
    assert not second.changed and second.unchanged == first.created
    layout = BandLayout([(b.name, b.partitions) for b in local.bands])
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka)
    await admin.start()
    try:
        counts = await partition_counts(admin)
    finally:
        await admin.close()
    assert counts[f"prompts.model-{unique}"] == layout.total_partitions
    for name in (topics.TOKENS, topics.CONTROL, topics.USAGE, topics.DEAD_LETTER):
        assert name in counts, f"the test command's bootstrap should have created {name}"


async def test_a_declaration_that_grows_adds_partitions(kafka: str, unique: str) -> None:
    name = f"grow-{unique}"
    await ensure_topics(kafka, [TopicSpec(name, 2)])
    report = await ensure_topics(kafka, [TopicSpec(name, 5)])
    assert report.grown == [name]


async def test_a_prompts_topic_that_grows_warns_that_bands_may_have_moved(
    kafka: str, unique: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Partitions are added at the end: growing any band but the last moved the
    partitions after it into another band, queued prompts with them, unsaid."""
    name = topics.prompts_topic(f"grow-{unique}")
    await ensure_topics(kafka, [TopicSpec(name, 3)])
    with caplog.at_level(logging.WARNING, logger="infra.topics"):
        await ensure_topics(kafka, [TopicSpec(name, 4)])
    assert f"{name} grew from 3 to 4 partitions" in caplog.text
    assert "moved to another band" in caplog.text


async def test_committed_offset_survives_a_consumer_restart(kafka: str, unique: str) -> None:
    topic, group = f"commit-{unique}", f"group-{unique}"
    await ensure_topics(kafka, [TopicSpec(topic, 1)])
    sent = [ControlEvent(command="cancel", request_id=f"r{i}", issued_at_ms=i) for i in range(10)]
    async with AIOKafkaProducer(bootstrap_servers=kafka, acks="all", enable_idempotence=True) as p:
        for event in sent:
            await p.send_and_wait(topic, encode(event), key=event.request_id.encode())

    first = await _consume(kafka, topic, group, count=6)
    second = await _consume(kafka, topic, group, count=4)

    assert [e.request_id for e in first + second] == [e.request_id for e in sent]


async def _consume(kafka: str, topic: str, group: str, count: int) -> list[ControlEvent]:
    """Read `count` events one by one, committing each, then leave the group."""
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=kafka,
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    await consumer.start()
    try:
        events = []
        for _ in range(count):
            record = await consumer.getone()
            events.append(decode(ControlEvent, record.value))
            tp = TopicPartition(record.topic, record.partition)
            await consumer.commit({tp: record.offset + 1})
        return events
    finally:
        await consumer.stop()


async def test_a_prompt_topic_narrower_than_its_bands_is_a_clear_error(
    kafka: str, unique: str, settings: Settings, producer: AIOKafkaProducer
) -> None:
    """Bands widened without `tandoor bootstrap`: aiokafka asserted on the partition the
    band picked (a bare 500 from the gateway, a retry loop without a word in admission)."""
    model = f"narrow-{unique}"
    await ensure_topics(kafka, [TopicSpec(topics.prompts_topic(model), 2)])
    prompt = PromptRequest(
        request_id=f"r-{unique}",
        model=model,
        user_id="u",
        tier="free",
        band="batch",  # the last band: past partition 1
        conversation_id="c",
        messages=[ChatMessage(role="user", content="Hi")],
        sampling=Sampling(max_tokens=4),
        created_at_ms=now_ms(),
    )
    with pytest.raises(KafkaError, match="run `tandoor bootstrap`"):
        await PromptSubmitter(settings, producer).submit(prompt)
