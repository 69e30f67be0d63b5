"""The whole stack for end-to-end tests (tests/e2e/stack.py), started once for the
package and its fault tests: two gateway processes, a worker with the bundled SmolLM2, a
worker with the bundled Gemma 3 (a second, different real model), the persistence
consumer, batch admission, and the real Kafka, Cassandra and Redis.

Two more model names test what happens when a model is busy. `big` has a worker that
takes nothing (infra/idle_worker.py): its prompts wait, and the free tier falls back to
the main model while it is backlogged. `idle` has no worker at all: its prompts are
refused at once, but for the free tier, which falls back."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from infra.process import free_port
from infra.roles import (
    AdmissionProcess,
    GatewayProcess,
    IdleWorkerProcess,
    PersistProcess,
    WorkerProcess,
    add_model,
    model_aliases,
    running,
    with_models,
)
from tandoor.models import BUNDLED_MODELS
from tandoor.settings import Fallback, Settings, TierPolicy
from tests.e2e.browser import browser, page  # noqa: F401 (the page tests' fixtures)
from tests.e2e.guarded import guarded  # noqa: F401 (the security tests' replica)
from tests.e2e.stack import BLOCKED_TERM, SHED_BACKLOG, Stack
from tests.engine import REFERENCE_DTYPE
from workers.model_store import resolve_model_dir

TIERS = {
    "free": TierPolicy(
        band="interactive-free",
        requests_per_minute=2,
        tokens_per_minute=100_000,
        concurrent_streams=2,
    ),
    # For the API fuzzer: no rate limits in its way, and replies of a few tokens (it tests
    # the HTTP surface; the engine's time would be all its time).
    "fuzz": TierPolicy(
        band="interactive-paid",
        requests_per_minute=100_000,
        tokens_per_minute=100_000_000,
        concurrent_streams=8,
        max_reply_tokens=4,
    ),
    # Replies of a few tokens, for the page's picker test (Gemma is slow on a CPU).
    "brief": TierPolicy(
        band="interactive-paid",
        requests_per_minute=100,
        tokens_per_minute=1_000_000,
        concurrent_streams=4,
        max_reply_tokens=8,
    ),
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
) -> AsyncIterator[Stack]:
    logs = tmp_path_factory.mktemp("stack")
    model_dir = await asyncio.to_thread(resolve_model_dir, "smollm2", cassandra)
    (model, big, idle), env = await model_aliases(cassandra, model_dir, ["gw", "big", "idle"])
    gemma_dir = await asyncio.to_thread(resolve_model_dir, "gemma3", cassandra)
    # Few slots: a reply of Gemma costs several times SmolLM2's on a CPU (its vocabulary).
    second, env = await add_model(
        cassandra, env, gemma_dir, "gemma", max_num_seqs=4, display_name=BUNDLED_MODELS["gemma3"]
    )
    env = with_models(env, dtype=REFERENCE_DTYPE)
    tiers = cassandra.tiers | TIERS
    env["TANDOOR_TIERS"] = json.dumps({name: p.model_dump() for name, p in tiers.items()})
    fallbacks = {
        big: Fallback(model=model, backlog=SHED_BACKLOG, tiers=["free"]),
        idle: Fallback(model=model, backlog=1000, tiers=["free"]),
        second: Fallback(model=model, backlog=1, tiers=["free"]),  # between two real models
    }
    env["TANDOOR_FALLBACKS"] = json.dumps({m: f.model_dump() for m, f in fallbacks.items()})
    env["TANDOOR_BACKLOG_POLL_S"] = "0.5"
    env["TANDOOR_MODERATION_BLOCKLIST"] = json.dumps([BLOCKED_TERM])
    env["TANDOOR_LOG_FORMAT"] = "json"  # test_operations follows request ids through them
    env["TANDOOR_WORKER_GRACE_S"] = "2"  # at teardown, no waiting for title jobs to end
    env["TANDOOR_BATCH_BACKLOG_PER_WORKER"] = "32"  # batch lines fill the worker: quicker
    settings = cassandra.model_copy(
        update={"models": [model, big, idle, second], "fallbacks": fallbacks, "tiers": tiers}
    )
    the_stack = Stack(
        settings,
        env,
        logs,
        model,
        big,
        idle,
        second,
        worker=WorkerProcess(model, logs, env),
        second_worker=WorkerProcess(second, logs, env),
        persist=PersistProcess(logs, env),
        admission=AdmissionProcess(logs, env),
        gateways=[GatewayProcess(logs, free_port(), env) for _ in range(2)],  # two replicas
    )
    async with running([IdleWorkerProcess(big, logs, env)]), the_stack.running():
        yield the_stack


@pytest.fixture
async def http(stack: Stack) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as client:
        yield client
