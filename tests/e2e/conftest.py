"""The whole stack for end-to-end tests, started once for the package: two gateway
processes, a worker with the bundled model, the persistence consumer, and the real
Kafka, Cassandra and Redis."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from infra.process import free_port
from infra.roles import GatewayProcess, PersistProcess, WorkerProcess, model_alias, running
from tandoor.settings import Settings
from tests.e2e.helpers import Stack
from workers.model_store import resolve_model_dir


@pytest.fixture(scope="package")
async def stack(
    kafka: str, cassandra: Settings, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Stack]:
    logs = tmp_path_factory.mktemp("stack")
    model_dir = await asyncio.to_thread(resolve_model_dir, "smollm2", cassandra)
    model, env = await model_alias(cassandra, model_dir, "gw")
    free = {
        "band": "interactive-free",
        "requests_per_minute": 2,
        "tokens_per_minute": 100_000,
        "concurrent_streams": 2,
    }
    tiers = {name: p.model_dump() for name, p in cassandra.tiers.items()} | {"free": free}
    env["TANDOOR_TIERS"] = json.dumps(tiers)
    gateways = [GatewayProcess(logs, free_port(), env) for _ in range(2)]  # two replicas
    async with running([WorkerProcess(model, logs, env), PersistProcess(logs, env), *gateways]):
        settings = cassandra.model_copy(update={"models": [model]})
        yield Stack(f"http://127.0.0.1:{gateways[0].port}", settings, gateways)


@pytest.fixture
async def http(stack: Stack) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as client:
        yield client
