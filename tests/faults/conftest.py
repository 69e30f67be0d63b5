"""The stack the fault tests break and mend: one worker, the persistence consumer and
two gateway replicas as child processes, over the test command's Kafka, Cassandra and
Redis. The tests stop and restart those servers too; every test leaves them running
and healthy (tests/integration and tests/unit come after this package)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from infra.process import free_port
from infra.roles import GatewayProcess, PersistProcess, WorkerProcess, model_aliases
from tandoor.settings import Settings, TierPolicy
from tests.faults.stack import FaultStack, servers_back
from workers.model_store import resolve_model_dir

# Generous limits: the faults, not the quotas, are under test (test_redis_down has its own).
ROOMY = {"requests_per_minute": 1000, "tokens_per_minute": 10_000_000, "concurrent_streams": 16}
TIERS = {
    "plus": TierPolicy(band="interactive-paid", redis_down="open", **ROOMY),
    "free": TierPolicy(band="interactive-free", redis_down="closed", **ROOMY),
    # Two requests a minute, served while Redis is down: the quota applies again after.
    "tight": TierPolicy(
        band="interactive-paid",
        redis_down="open",
        requests_per_minute=2,
        tokens_per_minute=10_000_000,
        concurrent_streams=16,
    ),
}


@pytest.fixture(scope="package")
async def stack(
    kafka: str, cassandra: Settings, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[FaultStack]:
    logs = tmp_path_factory.mktemp("faults")
    model_dir = await asyncio.to_thread(resolve_model_dir, "smollm2", cassandra)
    (model,), env = await model_aliases(cassandra, model_dir, ["fault"])
    env["TANDOOR_TIERS"] = json.dumps({name: p.model_dump() for name, p in TIERS.items()})
    settings = cassandra.model_copy(update={"models": [model], "tiers": TIERS})
    ports = [free_port(), free_port()]
    fault_stack = FaultStack(
        settings,
        env,
        logs,
        model,
        worker=WorkerProcess(model, logs, env),
        persist=PersistProcess(logs, env),
        gateways=[GatewayProcess(logs, port, env) for port in ports],
    )
    async with fault_stack.running():
        yield fault_stack


@pytest.fixture(autouse=True)
async def healthy_servers(stack: FaultStack) -> AsyncIterator[None]:
    """Whatever a test stopped comes back before the next one, even when it failed."""
    yield
    await servers_back(stack.settings)
    await stack.revive()
    await stack.usable()
