"""The whole stack for end-to-end tests, started once for the package: two gateway
processes, a worker with the bundled model, the persistence consumer, and the real
Kafka, Cassandra and Redis.

Two more model names are served by the gateways without a worker of their own: `big`
(the free tier falls back to the main model when it is backlogged) and `crash`, whose
workers a test starts and kills itself."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from infra.process import free_port
from infra.roles import GatewayProcess, PersistProcess, WorkerProcess, model_aliases, running
from tandoor.settings import Fallback, Settings, TierPolicy
from tests.e2e.helpers import SHED_BACKLOG, Stack
from workers.model_store import resolve_model_dir


@pytest.fixture(scope="package")
async def stack(
    kafka: str, cassandra: Settings, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Stack]:
    logs = tmp_path_factory.mktemp("stack")
    model_dir = await asyncio.to_thread(resolve_model_dir, "smollm2", cassandra)
    (model, big, crash), env = await model_aliases(cassandra, model_dir, ["gw", "big", "crash"])
    tiers = cassandra.tiers | {
        "free": TierPolicy(
            band="interactive-free",
            requests_per_minute=2,
            tokens_per_minute=100_000,
            concurrent_streams=2,
        ),
        # For the API fuzzer: no rate limits in its way, and short replies.
        "fuzz": TierPolicy(
            band="interactive-paid",
            requests_per_minute=100_000,
            tokens_per_minute=100_000_000,
            concurrent_streams=8,
            max_reply_tokens=16,
        ),
    }
    env["TANDOOR_TIERS"] = json.dumps({name: p.model_dump() for name, p in tiers.items()})
    fallbacks = {big: Fallback(model=model, backlog=SHED_BACKLOG, tiers=["free"])}
    env["TANDOOR_FALLBACKS"] = json.dumps({m: f.model_dump() for m, f in fallbacks.items()})
    env["TANDOOR_BACKLOG_POLL_S"] = "0.5"
    env["TANDOOR_LOG_FORMAT"] = "json"  # test_operations follows request ids through them
    gateways = [GatewayProcess(logs, free_port(), env) for _ in range(2)]  # two replicas
    worker, persist = WorkerProcess(model, logs, env), PersistProcess(logs, env)
    async with running([worker, persist, *gateways]):
        settings = cassandra.model_copy(
            update={"models": [model, big, crash], "fallbacks": fallbacks, "tiers": tiers}
        )
        url = f"http://127.0.0.1:{gateways[0].port}"
        yield Stack(url, settings, gateways, env, logs, model, big, crash, worker, persist)


@pytest.fixture
async def http(stack: Stack) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as client:
        yield client
