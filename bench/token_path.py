"""The token path without the engine: tokens per second from Kafka to SSE clients through
ONE gateway process, beside a bare Starlette SSE server streaming the same chunks from
memory (bench/sse_reference.py), with the same clients, in one run. A synthetic worker
(bench/synthetic_worker.py) answers every prompt at once with token events of
--tokens-per-event tokens, what the real worker's coalescing sends at full speed.

    python -m bench.token_path [--clients 32] [--requests 24] [--events 256]

The stack (Kafka, Cassandra, Redis) must be up: `tandoor infra up`. The target is
200,000 tokens/s per gateway process.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson

from bench.load_stack import HOLD_TIER, bench_tiers, tiers_env
from bench.machine import describe_machine
from bench.synthetic_worker import READY as SYNTHETIC_READY
from infra.process import free_port
from infra.roles import GatewayProcess, RoleProcess, model_alias, running, with_models
from tandoor.policies.api_keys import create_key
from tandoor.settings import Settings
from workers.model_store import resolve_model_dir

TARGET_TOKENS_PER_S = 200_000


class SyntheticWorker(RoleProcess):
    module = "bench.synthetic_worker"

    def __init__(self, model: str, args: argparse.Namespace, env: dict[str, str]) -> None:
        shape = ["--events", str(args.events), "--tokens-per-event", str(args.tokens_per_event)]
        super().__init__("synthetic-worker", [model, *shape], SYNTHETIC_READY, args.log_dir, env)


class ReferenceServer(RoleProcess):
    module = "bench.sse_reference"

    def __init__(self, port: int, args: argparse.Namespace) -> None:
        shape = ["--events", str(args.events), "--tokens-per-event", str(args.tokens_per_event)]
        ready = "Uvicorn running"
        super().__init__("sse-reference", [str(port), *shape], ready, args.log_dir, {})
        self.port = port


@dataclass
class Throughput:
    tokens: int = 0
    replies: int = 0
    errors: int = 0
    wall_s: float = 0.0

    @property
    def per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


class ReplyFailed(Exception):
    """A stream that ended in an error chunk, or without its usage: not a reply."""


async def stream_once(client: httpx.AsyncClient, url: str, model: str, key: str) -> int:
    """One streamed completion; its completion tokens, from the usage chunk."""
    body = {
        "model": model,
        "stream": True,
        "max_tokens": 64,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "Stream."}],
    }
    headers = {"Authorization": f"Bearer {key}"}
    tokens: int | None = None
    async with client.stream("POST", url, json=body, headers=headers) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = orjson.loads(line[6:])
            if chunk.get("error"):
                raise ReplyFailed(chunk["error"])
            if usage := chunk.get("usage"):
                tokens = int(usage["completion_tokens"])
    if tokens is None:
        raise ReplyFailed("the stream ended without its usage")
    return tokens


async def load(base_url: str, model: str, key: str, args: argparse.Namespace) -> Throughput:
    result = Throughput()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    url = f"{base_url}/v1/chat/completions"
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(300)) as client:
        await stream_once(client, url, model, key)  # warm-up

        async def one_client() -> None:
            for _ in range(args.requests):
                try:
                    tokens = await stream_once(client, url, model, key)  # then add:
                    result.tokens += tokens  # `x += await f()` reads x before awaiting
                    result.replies += 1
                except (httpx.HTTPError, ReplyFailed) as exc:
                    result.errors += 1
                    print(f"  error: {exc!r}")

        started = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(args.clients)))
        result.wall_s = time.perf_counter() - started
    return result


async def bench_reference(args: argparse.Namespace) -> Throughput:
    server = ReferenceServer(free_port(), args)
    async with running([server]):
        return await load(f"http://127.0.0.1:{server.port}", "reference", "none", args)


async def bench_gateway(args: argparse.Namespace) -> Throughput:
    settings = Settings()
    model_dir = await asyncio.to_thread(resolve_model_dir, "smollm2", settings)
    model, env = await model_alias(settings, model_dir, "tokenpath")
    tiers = bench_tiers(settings, args.clients + 1)
    env = with_models(env) | tiers_env(tiers)
    gateway = GatewayProcess(args.log_dir, free_port(), env)
    async with running([SyntheticWorker(model, args, env), gateway]):
        with_tiers = settings.model_copy(update={"tiers": tiers})
        key, _ = await create_key(with_tiers, f"bench-{model}", HOLD_TIER)
        return await load(f"http://127.0.0.1:{gateway.port}", model, key, args)


def report(name: str, result: Throughput) -> str:
    return (
        f"{name:<34}{result.replies:>8}{result.errors:>7}{result.tokens:>11}"
        f"{result.wall_s:>9.1f}{result.per_s:>13,.0f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument(
        "--requests", type=int, default=24, help="per client (fewer: warm-up dominates)"
    )
    parser.add_argument("--events", type=int, default=256, help="per reply")
    parser.add_argument("--tokens-per-event", type=int, default=16)
    parser.add_argument("--log-dir", type=Path, default=Path(".tandoor/bench"))
    args = parser.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    print(describe_machine(), flush=True)
    reference = asyncio.run(bench_reference(args))
    gateway = asyncio.run(bench_gateway(args))
    print(
        f"{args.clients} clients x {args.requests} streamed replies of {args.events} chunks "
        f"x {args.tokens_per_event} tokens"
    )
    print(f"{'target':<34}{'replies':>8}{'errors':>7}{'tokens':>11}{'wall s':>9}{'tokens/s':>13}")
    print(report("bare Starlette SSE (reference)", reference))
    print(report("Tandoor gateway, Kafka to SSE", gateway))
    print(
        f"gateway/reference {gateway.per_s / reference.per_s:.1%}; target "
        f"{TARGET_TOKENS_PER_S:,} tokens/s per gateway process: "
        f"{'met' if gateway.per_s >= TARGET_TOKENS_PER_S else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
