"""A member of a model's worker group that takes nothing, as a stuck worker would: the
gateway sees a worker (so it does not refuse the model as unserved) while prompts stay
in Kafka, which keeps replies running for as long as a test or a benchmark needs.

`python -m infra.idle_worker <model>` runs one until SIGTERM (infra.roles.IdleWorkerProcess):
in a test process its Kafka client would share the `random` module with hypothesis."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener

from schemas.topics import prompts_topic, worker_group
from tandoor.settings import Settings

DAY_MS = 24 * 3600 * 1000
JOIN_TIMEOUT_S = 120.0
READY = "idle worker ready"


class _Joined(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self) -> None:
        self.event = asyncio.Event()

    async def on_partitions_revoked(self, revoked: object) -> None:
        pass

    async def on_partitions_assigned(self, assigned: object) -> None:
        self.event.set()


@asynccontextmanager
async def idle_worker(settings: Settings, model: str) -> AsyncIterator[AIOKafkaConsumer]:
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.kafka_bootstrap,
        group_id=worker_group(model),
        enable_auto_commit=False,
        max_poll_interval_ms=DAY_MS,  # never polled: it must not be dropped for that
    )
    joined = _Joined()
    consumer.subscribe([prompts_topic(model)], listener=joined)
    await consumer.start()
    try:
        async with asyncio.timeout(JOIN_TIMEOUT_S):  # the group's join, not the engine
            await joined.event.wait()
        yield consumer
    finally:
        await consumer.stop()


async def _serve(model: str) -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with idle_worker(Settings(), model):
        print(f"{READY}: a member of {worker_group(model)} that takes nothing", flush=True)
        await stop.wait()


if __name__ == "__main__":
    asyncio.run(_serve(sys.argv[1]))
