"""The whole chat path (gateway -> Kafka -> worker -> Kafka -> gateway, persistence
running beside it) against vLLM's own OpenAI server: the same OpenAI-style streaming
client, model, engine settings and load, one after the other on this machine.

    python -m bench.gateway_vs_vllm [--requests-per-stream 2] [--max-tokens 128] [--rounds 3]

The stack (Kafka, Cassandra, Redis) must be up: `tandoor infra up`.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.loadgen import (
    Probe,
    RunStats,
    alternate,
    cpu_table,
    measure,
    openai_sender,
    parse_args,
)
from bench.machine import describe_machine
from bench.procstats import pid_of
from bench.vllm_server import bench_direct, engine_settings
from infra.process import free_port
from infra.roles import (
    GatewayProcess,
    PersistProcess,
    RoleProcess,
    WorkerProcess,
    model_alias,
    running,
    with_models,
)
from infra.stack import Stack as InfraStack
from tandoor.policies.api_keys import create_key
from tandoor.settings import Settings
from workers.model_store import resolve_model_dir

WORKER_SECONDS = {  # the worker's histograms: where the gateway path's TTFT goes
    "queue": "tandoor_worker_queue_seconds",  # prompt created -> in the engine
    "first token": "tandoor_worker_time_to_first_token_seconds",  # created -> first token
}


async def worker_latency(worker: RoleProcess) -> dict[str, float]:
    """Each histogram's _sum and _count so far, summed over bands."""
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(f"http://127.0.0.1:{worker.ops_port()}/metrics")).text
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for name, metric in WORKER_SECONDS.items():
                for part in ("_sum", "_count"):
                    if sample.name == metric + part:
                        found[name + part] = found.get(name + part, 0.0) + sample.value
    return found


def latency_table(runs: list[tuple[str, RunStats]]) -> str:
    """The worker's mean queue time and time to first token at each level, beside the
    client's TTFT: what is left is the way back to the client (Kafka, the gateway, and
    the redaction's hold of the last, unfinished word)."""
    lines = []
    for _, stats in runs:
        c = stats.counted
        means = {
            name: 1000 * c[f"{name}_sum"] / c[f"{name}_count"]
            for name in WORKER_SECONDS
            if c.get(f"{name}_count")
        }
        shown = ", ".join(f"{name} {ms:.1f} ms" for name, ms in means.items())
        mean_ttft = 1000 * sum(stats.ttft_s) / len(stats.ttft_s) if stats.ttft_s else 0.0
        lines.append(
            f"gateway path @{stats.concurrency}: worker means {shown}; client TTFT mean "
            f"{mean_ttft:.1f} ms"
        )
    return "\n".join(lines)


def servers(settings: Settings) -> dict[str, int]:
    """Kafka, Cassandra and Redis: they run through both halves of the comparison."""
    return {s.name: s.pid for s in InfraStack(settings).status() if s.pid is not None}


async def bench_gateway(model_dir: Path, args: argparse.Namespace) -> list[tuple[str, RunStats]]:
    settings = Settings()
    model, env = await model_alias(settings, model_dir, "bench")
    # Its own persist group, started at the end of `tokens` (model_alias): the
    # long-lived "persist" group, unread while benchmarks and tests ran, first stored
    # their backlog, on the engine's cores, in the gateway half only.
    env = with_models(env, None, **engine_settings(args))
    gateway = GatewayProcess(args.log_dir, free_port(), env)
    roles = [WorkerProcess(model, args.log_dir, env), PersistProcess(args.log_dir, env), gateway]
    async with running(roles):
        processes = {role.name: pid_of(role) for role in roles} | servers(settings)
        probe = Probe(processes, lambda: worker_latency(roles[0]))
        key, _ = await create_key(settings, f"bench-{model}", "api")
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(limits=limits) as client:
            url = f"http://127.0.0.1:{gateway.port}"
            send = openai_sender(client, url, model, args, key)
            return await measure("Tandoor gateway (full path)", send, args, probe)


def main() -> None:
    args = parse_args(__doc__)
    print(describe_machine(), flush=True)
    model_dir = resolve_model_dir("smollm2", Settings())
    pairs = alternate(
        args.rounds,
        lambda: asyncio.run(bench_direct(model_dir, args, servers(Settings()))),
        lambda: asyncio.run(bench_gateway(model_dir, args)),
        "gateway",
    )
    for direct, gateway in pairs:
        print(cpu_table(direct + gateway))
        print(latency_table(gateway))


if __name__ == "__main__":
    main()
