"""What the gateway load phases share: tiers with the quotas out of the way, the
whole stack started on a fresh model name, and the HTTP clients."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx

from infra.process import free_port
from infra.roles import (
    GatewayProcess,
    PersistProcess,
    WorkerProcess,
    model_aliases,
    running,
    with_models,
)
from tandoor.settings import Settings, TierPolicy
from workers.model_store import resolve_model_dir

HOLD_TIER = "hold"  # the streams phase's users: one stream each is far too few
REPLY_TIMEOUT = httpx.Timeout(300)


def _tier(band: str, streams: int) -> TierPolicy:
    """Quotas out of the way: the bench measures the serving path, not the limits."""
    return TierPolicy(
        band=band,
        requests_per_minute=1_000_000,
        tokens_per_minute=1_000_000_000,
        concurrent_streams=streams,
    )


def bench_tiers(settings: Settings, hold_streams: int) -> dict[str, TierPolicy]:
    return settings.tiers | {
        "free": _tier("interactive-free", 8),
        "plus": _tier("interactive-paid", 8),
        HOLD_TIER: _tier("interactive-paid", hold_streams),
    }


def tiers_env(tiers: dict[str, TierPolicy]) -> dict[str, str]:
    return {"TANDOOR_TIERS": json.dumps({name: p.model_dump() for name, p in tiers.items()})}


def gateway_client(port: int, timeout: httpx.Timeout) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=timeout)


@dataclass
class FullStack:
    settings: Settings  # with the bench's tiers and persist group
    model: str
    gateway: GatewayProcess
    worker: WorkerProcess
    persist: PersistProcess
    client: httpx.AsyncClient


@asynccontextmanager
async def full_stack(args: argparse.Namespace) -> AsyncIterator[FullStack]:
    settings = Settings()
    model_dir = await asyncio.to_thread(resolve_model_dir, "smollm2", settings)
    (model,), env = await model_aliases(settings, model_dir, ["load"])
    tiers = bench_tiers(settings, 1)
    env = with_models(env, max_num_seqs=args.max_seqs) | tiers_env(tiers)
    settings = settings.model_copy(
        update={"tiers": tiers, "persist_group": env["TANDOOR_PERSIST_GROUP"]}
    )
    gateway = GatewayProcess(args.log_dir, free_port(), env)
    worker, persist = WorkerProcess(model, args.log_dir, env), PersistProcess(args.log_dir, env)
    async with (
        running([worker, persist, gateway]),
        gateway_client(gateway.port, REPLY_TIMEOUT) as client,
    ):
        yield FullStack(settings, model, gateway, worker, persist, client)
