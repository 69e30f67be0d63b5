"""Load shedding: which model answers a prompt, given how far behind its workers are.

A model's backlog is what its prompt topic holds beyond the worker group's commits:
prompts waiting plus those being generated. It is measured in the background every
`backlog_poll_s`, so admitting a prompt never waits on Kafka for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from schemas.topics import prompts_topic, worker_group
from tandoor.settings import Settings

log = logging.getLogger(__name__)


class BacklogMonitor:
    """The latest backlog of each model that has a fallback."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.models = sorted(settings.fallbacks)
        self._partitions = sum(band.partitions for band in settings.bands)
        self._backlog: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None

    def backlog(self, model: str) -> int | None:
        """None until measured, or when Kafka could not be asked lately."""
        return self._backlog.get(model)

    async def start(self) -> None:
        if self.models:
            self._task = asyncio.create_task(self._poll(), name="backlog-monitor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _poll(self) -> None:
        async with backlog_clients(self.settings) as (admin, offsets):
            while True:
                for model in self.models:
                    try:
                        self._backlog[model] = await count_backlog(
                            admin, offsets, self._partitions, model
                        )
                    except (KafkaError, OSError, KeyError) as exc:
                        self._backlog.pop(model, None)  # unknown: never shed on stale figures
                        log.warning("backlog of %s unknown: %r", model, exc)
                await asyncio.sleep(self.settings.backlog_poll_s)


@asynccontextmanager
async def backlog_clients(
    settings: Settings,
) -> AsyncIterator[tuple[AIOKafkaAdminClient, AIOKafkaConsumer]]:
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    offsets = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap, enable_auto_commit=False)
    await admin.start()
    try:
        await offsets.start()
        try:
            yield admin, offsets
        finally:
            await offsets.stop()
    finally:
        await admin.close()


async def count_backlog(
    admin: AIOKafkaAdminClient, offsets: AIOKafkaConsumer, partitions: int, model: str
) -> int:
    """Prompts in the model's topic past its workers' commits."""
    tps = [TopicPartition(prompts_topic(model), p) for p in range(partitions)]
    ends = await offsets.end_offsets(tps)
    starts = await offsets.beginning_offsets(tps)
    committed = await admin.list_consumer_group_offsets(worker_group(model))
    backlog = 0
    for tp in tps:
        done = committed[tp].offset if tp in committed else starts[tp]
        backlog += max(0, ends[tp] - max(done, starts[tp]))
    return backlog


class ModelRouter:
    """The model that answers: the asked one, or its fallback while it is overloaded."""

    def __init__(self, settings: Settings, backlog: Callable[[str], int | None]) -> None:
        self.settings = settings
        self.backlog = backlog

    def answering(self, model: str, tier: str) -> str:
        rule = self.settings.fallbacks.get(model)
        if rule is None or tier not in rule.tiers:
            return model
        backlog = self.backlog(model)
        if backlog is None or backlog < rule.backlog:
            return model
        log.info(
            "shedding %s: backlog %d >= %d, %s answers", model, backlog, rule.backlog, rule.model
        )
        return rule.model
