"""The whole chat path (gateway -> Kafka -> worker -> Kafka -> gateway, persistence
running beside it) against vLLM's own OpenAI server: the same OpenAI-style streaming
client, model, engine settings and load, one after the other on this machine.

    python -m bench.gateway_vs_vllm [--requests-per-stream 2] [--max-tokens 128]

The stack (Kafka, Cassandra, Redis) must be up: `tandoor infra up`.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import httpx

from bench.loadgen import RunStats, compare, measure, openai_sender, parse_args
from bench.machine import describe_machine
from bench.vllm_server import bench_direct
from infra.process import free_port
from infra.roles import (
    GatewayProcess,
    PersistProcess,
    WorkerProcess,
    model_alias,
    running,
    with_models,
)
from tandoor.policies.api_keys import create_key
from tandoor.settings import Settings
from workers.model_store import resolve_model_dir


async def bench_gateway(model_dir: Path, args: argparse.Namespace) -> list[tuple[str, RunStats]]:
    settings = Settings()
    model, env = await model_alias(settings, model_dir, "bench")
    env = with_models(env, max_num_seqs=args.max_seqs, kv_cache_mib=args.kv_cache_mib)
    env |= {
        # The long-lived group, caught up as in production: a fresh group would first
        # replay all of `tokens` and compete with the measurement for the CPU.
        "TANDOOR_PERSIST_GROUP": "persist",
    }
    gateway = GatewayProcess(args.log_dir, free_port(), env)
    roles = [WorkerProcess(model, args.log_dir, env), PersistProcess(args.log_dir, env), gateway]
    async with running(roles):
        key, _ = await create_key(settings, f"bench-{model}", "api")
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(limits=limits) as client:
            url = f"http://127.0.0.1:{gateway.port}"
            send = openai_sender(client, url, model, args.max_tokens, key)
            return await measure("Tandoor gateway (full path)", send, args)


def main() -> None:
    args = parse_args(__doc__)
    print(describe_machine(), flush=True)
    model_dir = resolve_model_dir("smollm2", Settings())
    direct = asyncio.run(bench_direct(model_dir, args))
    print(compare(direct, asyncio.run(bench_gateway(model_dir, args)), "gateway"))


if __name__ == "__main__":
    main()
