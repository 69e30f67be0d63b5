"""Work whoever started it does not wait for: kept referenced until it ends (the event
loop holds tasks weakly: one nobody else holds can be collected midway), and waited
for when its owner shuts down, before what it uses (Kafka, Redis) is closed."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterator
from typing import Any

log = logging.getLogger(__name__)


class Background:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[asyncio.Task[None]]:
        return iter(set(self._tasks))  # a copy: a task may end while it is looked at

    def start(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def finish(self, within_s: float) -> None:
        """Wait for the work (that started meanwhile too) up to `within_s`, then cancel
        what is left: a stop of a reply its client left, sent before the producer closes."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while self._tasks and (left_s := deadline - loop.time()) > 0:
            done, _ = await asyncio.wait(set(self._tasks), timeout=left_s)
            self._report(done)
        if self._tasks:
            log.warning("%d background tasks unfinished at shutdown: cancelled", len(self))
            await self.cancel()

    async def cancel(self) -> None:
        tasks = set(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._report(tasks)

    @staticmethod
    def _report(tasks: set[asyncio.Task[None]]) -> None:
        for task in tasks:
            if not task.cancelled() and (failure := task.exception()) is not None:
                log.error("background task failed: %r", failure, exc_info=failure)
