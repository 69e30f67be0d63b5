"""Every worker reads every control event (no consumer group): a cancel must reach
whichever worker holds the request, or will take it later (then Redis tells)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiokafka import AIOKafkaConsumer

from schemas import topics
from schemas.codec import SchemaError, decode
from schemas.events import ControlEvent
from tandoor.clients import assign_from_end
from tandoor.settings import Settings

log = logging.getLogger(__name__)

# A long poll still returns as soon as a cancel arrives (fetch_min_bytes is 1); a
# longer wait only means fewer empty fetches.
CONTROL_FETCH_WAIT_MS = 250

OnCancel = Callable[[ControlEvent], Awaitable[None]]


class ControlListener:
    def __init__(self, settings: Settings, on_cancel: OnCancel) -> None:
        self._on_cancel = on_cancel
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=settings.kafka_bootstrap,
            group_id=None,
            enable_auto_commit=False,
            fetch_max_wait_ms=CONTROL_FETCH_WAIT_MS,
        )
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._consumer.start()
        try:
            await assign_from_end(self._consumer, topics.CONTROL)  # older cancels are in Redis
        except BaseException:
            await self._consumer.stop()
            raise
        self.task = asyncio.create_task(self._listen(), name="control-listener")

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
            self.task = None
        await self._consumer.stop()

    async def _listen(self) -> None:
        async for record in self._consumer:
            try:
                event = decode(ControlEvent, record.value)
            except SchemaError as exc:
                log.warning("ignoring malformed control event at offset %s: %s", record.offset, exc)
                continue
            if event.command == "cancel":
                await self._on_cancel(event)
