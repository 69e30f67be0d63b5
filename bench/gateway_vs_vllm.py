"""The whole chat path (gateway -> Kafka -> worker -> Kafka -> gateway, persistence
running beside it) against vLLM's own OpenAI server: the same OpenAI-style streaming
client, model, engine settings and load, one after the other on this machine.

    python -m bench.gateway_vs_vllm [--requests-per-stream 2] [--max-tokens 128]

The stack (Kafka, Cassandra, Redis) must be up: `tandoor infra up`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid
from pathlib import Path

import httpx

from bench.loadgen import RunStats, compare, openai_sender, parse_args, run_level
from bench.vllm_server import bench_direct
from infra.process import free_port
from infra.roles import GatewayProcess, PersistProcess, RoleProcess, WorkerProcess
from infra.topics import TopicSpec, ensure_topics
from producers.keys import create_key
from schemas import topics
from tandoor.settings import Settings
from workers.model_store import resolve_model_dir


async def bench_gateway(model_dir: Path, args: argparse.Namespace) -> list[tuple[str, RunStats]]:
    settings = Settings()
    model = f"bench-{uuid.uuid4().hex[:6]}"
    partitions = sum(b.partitions for b in settings.bands)
    await ensure_topics(
        settings.kafka_bootstrap, [TopicSpec(topics.prompts_topic(model), partitions)]
    )
    env = {
        "TANDOOR_MODELS": json.dumps([model]),
        "TANDOOR_MODEL_DIRS": json.dumps({model: str(model_dir)}),
        "TANDOOR_WORKER_MAX_SEQS": str(args.max_seqs),
        "TANDOOR_WORKER_KV_CACHE_MIB": str(args.kv_cache_mib),
        "TANDOOR_GATEWAY_GROUP": f"gateway-{model}",
        "TANDOOR_PERSIST_GROUP": f"persist-{model}",
    }
    port = free_port()
    roles: list[RoleProcess] = [
        WorkerProcess(model, args.log_dir, env),
        PersistProcess(args.log_dir, env),
        GatewayProcess(args.log_dir, port, env),
    ]
    for role in roles:
        role.start()
    try:
        await asyncio.gather(*(role.wait_ready() for role in roles))
        key, _ = await create_key(settings, f"bench-{model}", "api")
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(limits=limits) as client:
            send = openai_sender(client, f"http://127.0.0.1:{port}", model, args.max_tokens, key)
            await run_level(send, 4, 1)  # warm-up
            return [
                ("Tandoor gateway (full path)", await run_level(send, c, args.requests_per_stream))
                for c in args.concurrency
            ]
    finally:
        for role in roles:
            role.terminate()


def main() -> None:
    args = parse_args(__doc__)
    model_dir = resolve_model_dir("smollm2", Settings())
    direct = asyncio.run(bench_direct(model_dir, args))
    print(compare(direct, asyncio.run(bench_gateway(model_dir, args)), "gateway"))


if __name__ == "__main__":
    main()
