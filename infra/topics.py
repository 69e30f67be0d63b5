"""Every Kafka topic Tandoor uses, declared once, created idempotently."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewPartitions, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from infra.errors import InfraError
from schemas import topics
from tandoor.settings import Settings

log = logging.getLogger(__name__)

HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    config: dict[str, str] = field(default_factory=dict)
    replication: int = 1


def declared_topics(settings: Settings) -> list[TopicSpec]:
    band_partitions = sum(band.partitions for band in settings.bands)
    week, month = str(7 * DAY_MS), str(30 * DAY_MS)
    specs = [
        *((topics.prompts_topic(model), band_partitions, week) for model in settings.models),
        # Replies are re-read by reconnecting clients for a while, then dropped.
        (topics.TOKENS, settings.tokens_partitions, str(DAY_MS)),
        (topics.CONTROL, 4, str(HOUR_MS)),
        (topics.USAGE, topics.USAGE_PARTITIONS, month),
        (topics.USAGE_ROLLUPS, topics.USAGE_PARTITIONS, month),
        (topics.BATCH_REQUESTS, topics.BATCH_PARTITIONS, week),
        (topics.BATCH_RESULTS, topics.BATCH_PARTITIONS, week),
        (topics.DEAD_LETTER, 1, month),
    ]
    return [
        TopicSpec(name, partitions, {"retention.ms": retention}, settings.kafka_replication_factor)
        for name, partitions, retention in specs
    ]


@dataclass
class TopicReport:
    created: list[str] = field(default_factory=list)
    grown: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.created or self.grown)


async def ensure_topics(bootstrap: str, specs: list[TopicSpec]) -> TopicReport:
    """Create missing topics and add partitions where a declaration grew."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=15_000)
    try:
        await admin.start()  # within: a start that fails leaves its connections open too
        existing = await partition_counts(admin)
        report = TopicReport()
        missing = [spec for spec in specs if spec.name not in existing]
        if missing:
            response = await admin.create_topics([_new_topic(spec) for spec in missing])
            already = _already_existing(response.topic_errors)
            report.created = [spec.name for spec in missing if spec.name not in already]
            # Our metadata was stale (a topic created a moment ago): read it again.
            existing.update(await _wait_for_counts(admin, already))
        for spec in specs:
            if spec.name in existing:
                await _grow(admin, spec, existing[spec.name], report)
        return report
    finally:
        await admin.close()


async def partition_counts(
    admin: AIOKafkaAdminClient, names: list[str] | None = None
) -> dict[str, int]:
    names = await admin.list_topics() if names is None else names
    described = await admin.describe_topics(names) if names else []
    return {item["topic"]: len(item["partitions"]) for item in described if item["error_code"] == 0}


async def _wait_for_counts(admin: AIOKafkaAdminClient, names: list[str]) -> dict[str, int]:
    for _ in range(50):
        counts = await partition_counts(admin, names)
        if len(counts) == len(names):
            return counts
        await asyncio.sleep(0.1)
    raise InfraError(f"topics {names} exist but their metadata never became readable")


def _already_existing(topic_errors: list[tuple[str, int, str | None]]) -> list[str]:
    already = []
    for name, code, message in topic_errors:
        if code == TopicAlreadyExistsError.errno:
            already.append(name)
        elif code != 0:
            raise InfraError(f"creating topic {name} failed (Kafka error {code}): {message}")
    return already


async def _grow(
    admin: AIOKafkaAdminClient, spec: TopicSpec, current: int, report: TopicReport
) -> None:
    if current == spec.partitions:
        report.unchanged.append(spec.name)
    elif current < spec.partitions:
        await admin.create_partitions({spec.name: NewPartitions(total_count=spec.partitions)})
        report.grown.append(spec.name)
        if spec.name.startswith(topics.PROMPTS_PREFIX):
            log.warning(
                "%s grew from %d to %d partitions, added after the last band: unless only "
                "the last band grew, partitions of later bands moved to another band "
                "(prompts queued there are served in their new band)",
                spec.name,
                current,
                spec.partitions,
            )
    else:
        raise InfraError(
            f"topic {spec.name} has {current} partitions but {spec.partitions} are declared; "
            "Kafka cannot remove partitions: recreate the topic or raise the declaration"
        )


def _new_topic(spec: TopicSpec) -> NewTopic:
    return NewTopic(
        spec.name, spec.partitions, replication_factor=spec.replication, topic_configs=spec.config
    )


def token_partitions(settings: Settings) -> list[TopicPartition]:
    """`tokens` is created with settings.tokens_partitions (declared_topics above)."""
    return [TopicPartition(topics.TOKENS, p) for p in range(settings.tokens_partitions)]


async def start_group_at_end(
    settings: Settings, group: str, partitions: list[TopicPartition] | None = None
) -> None:
    """Commit the end of `partitions` (all of `tokens` by default) for a fresh group, so
    a consumer started in it reads only what comes next instead of replaying what the
    shared topic retains."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.kafka_bootstrap, group_id=group, enable_auto_commit=False
    )
    await consumer.start()
    try:
        tps = partitions or token_partitions(settings)
        consumer.assign(tps)  # commit() needs the partitions assigned
        ends = await consumer.end_offsets(tps)
        await consumer.commit(dict(ends))
    finally:
        await consumer.stop()


def batch_request_partitions() -> list[TopicPartition]:
    return [TopicPartition(topics.BATCH_REQUESTS, p) for p in range(topics.BATCH_PARTITIONS)]
