"""Integration tests use the server fixtures of tests/conftest.py, and share one worker:
an engine takes about a minute to start on a slow CPU."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer

from infra.roles import WorkerProcess
from infra.topics import TopicSpec, batch_request_partitions, ensure_topics, start_group_at_end
from producers.batch_topic import ResultsReader
from schemas import topics
from tandoor.clients import cassandra_session, kafka_producer, redis_client
from tandoor.settings import Settings
from tests.engine import REFERENCE_DTYPE
from tests.integration.batch_lines import BACKLOG_PER_WORKER, BLOCKED
from tests.integration.persisting import (  # noqa: F401 (the persistence tests' fixtures)
    dead_letter,
    keyspace,
    persist_env,
    start_persist,
)
from workers.model_store import resolve_model_dir

MAX_SEQS = 16
# The worker's engine window, set through TANDOOR_MODELS (not vLLM's default of 2048).
CONTEXT_TOKENS = 1536
MAX_TOKENS = 1200  # small, so a long request makes the next one wait inside the worker
# Coalescing by count only (the window is longer than any reply), so how tokens are
# grouped into events does not depend on how fast this CPU generates them.
COALESCE_TOKENS = 4


@pytest.fixture
def session(cassandra: Settings, migrated_keyspace: str) -> Iterator[Any]:
    """A Cassandra session on this test's own migrated keyspace."""
    with cassandra_session(cassandra, migrated_keyspace) as s:
        yield s


class SharedWorker:
    """The package's worker, started when first needed; a test that stopped it (SIGTERM
    is tested too) leaves the next test a new one of the same model."""

    def __init__(self, model: str, logs: Path, env: dict[str, str]) -> None:
        self.model, self.logs, self.env = model, logs, env
        self.process: WorkerProcess | None = None

    async def alive(self) -> WorkerProcess:
        if (
            self.process is None
            or self.process.proc is None
            or self.process.proc.poll() is not None
        ):
            self.process = WorkerProcess(self.model, self.logs, self.env)
            self.process.start()
            await self.process.wait_ready()
        return self.process

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()


@pytest.fixture(scope="package")
async def shared_worker(
    kafka: str, redis_url: str, settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[SharedWorker]:
    model = f"wa-{uuid.uuid4().hex[:6]}"
    bands = sum(b.partitions for b in settings.bands)
    await ensure_topics(settings.kafka_bootstrap, [TopicSpec(topics.prompts_topic(model), bands)])
    model_dir = await asyncio.to_thread(resolve_model_dir, "smollm2", settings)
    env = {
        "TANDOOR_MODELS": json.dumps(
            {
                model: {
                    "source": str(model_dir),
                    "max_num_seqs": MAX_SEQS,
                    "max_model_len": CONTEXT_TOKENS,
                    "dtype": REFERENCE_DTYPE,
                }
            }
        ),
        "TANDOOR_WORKER_MAX_TOKENS": str(MAX_TOKENS),
        "TANDOOR_COALESCE_MS": "3600000",
        "TANDOOR_COALESCE_TOKENS": str(COALESCE_TOKENS),
        "TANDOOR_WORKER_GRACE_S": "2",  # SIGTERM: longer replies are handed back
    }
    shared = SharedWorker(model, tmp_path_factory.mktemp("workers"), env)
    yield shared
    shared.stop()


@pytest.fixture
async def worker(shared_worker: SharedWorker) -> WorkerProcess:
    """The shared worker, running."""
    return await shared_worker.alive()


@pytest.fixture(scope="package")
async def producer(kafka: str, settings: Settings) -> AsyncIterator[AIOKafkaProducer]:
    async with kafka_producer(settings, client_id="tests") as p:
        yield p


@pytest.fixture
async def redis(settings: Settings, redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = redis_client(settings)
    yield client
    await client.aclose()


@pytest.fixture
async def roles_env(settings: Settings, shared_worker: SharedWorker) -> dict[str, str]:
    """Admission and persist in groups of their own, from the end of their topics."""
    tag = uuid.uuid4().hex[:8]
    env = {
        "TANDOOR_MODELS": shared_worker.env["TANDOOR_MODELS"],
        "TANDOOR_ADMISSION_GROUP": f"admission-{tag}",
        "TANDOOR_PERSIST_GROUP": f"persist-batch-{tag}",
        "TANDOOR_BATCH_BACKLOG_PER_WORKER": str(BACKLOG_PER_WORKER),
        "TANDOOR_MODERATION_BLOCKLIST": json.dumps([BLOCKED]),
    }
    await start_group_at_end(settings, env["TANDOOR_PERSIST_GROUP"])
    await start_group_at_end(settings, env["TANDOOR_ADMISSION_GROUP"], batch_request_partitions())
    return env


@pytest.fixture
async def results(settings: Settings) -> AsyncIterator[ResultsReader]:
    """Results on `batch.results` from the start of the test."""
    reader = ResultsReader(settings.kafka_bootstrap)
    await reader.start()
    yield reader
    await reader.stop()
