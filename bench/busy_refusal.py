"""How long a refused busy request takes, beside two references in the same run on one
gateway process:

  refused    POST a message to a model no worker serves: the 503 with Retry-After
  not found  GET a conversation that does not exist: the 404 (auth and one read)
  admitted   POST a message to a model whose worker takes nothing
             (infra/idle_worker.py): the time to the stream's start event

    python -m bench.busy_refusal [--requests 200]

Runs against the servers of the environment (`tandoor infra up`); it starts its own
gateway on fresh model names and stops it on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

from bench.load_stack import HOLD_TIER, bench_tiers, gateway_client, tiers_env
from bench.machine import describe_machine
from infra.idle_worker import idle_worker
from infra.process import free_port
from infra.roles import GatewayProcess, model_aliases, running
from tandoor.policies.api_keys import create_key
from tandoor.settings import Settings
from workers.model_store import resolve_model_dir

ADMITTED = 24


async def refused(http: httpx.AsyncClient, headers: dict[str, str], conversation: str) -> int:
    path = f"/v1/conversations/{conversation}/messages"
    response = await http.post(path, json={"content": "Anyone?"}, headers=headers)
    assert response.status_code == 503 and response.headers["Retry-After"], response.text
    return response.status_code


async def not_found(http: httpx.AsyncClient, headers: dict[str, str]) -> int:
    response = await http.get("/v1/conversations/c_missing", headers=headers)
    assert response.status_code == 404, response.text
    return response.status_code


async def admitted(http: httpx.AsyncClient, headers: dict[str, str], model: str) -> int:
    created = await http.post("/v1/conversations", json={"model": model}, headers=headers)
    path = f"/v1/conversations/{created.json()['id']}/messages"
    async with http.stream("POST", path, json={"content": "Hi?"}, headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                return r.status_code
    raise AssertionError("no start event")


async def timed(count: int, request: Callable[[], Awaitable[int]]) -> list[float]:
    await request()  # warm: connections, caches
    times = []
    for _ in range(count):
        started = time.perf_counter()
        await request()
        times.append((time.perf_counter() - started) * 1000)
    return times


def row(name: str, times: list[float]) -> str:
    q = statistics.quantiles(times, n=20)
    return f"| {name} | {len(times)} | {statistics.median(times):.1f} | {q[18]:.1f} |"


async def main(args: argparse.Namespace) -> None:
    settings = Settings()
    print(describe_machine(settings))
    model_dir = await asyncio.to_thread(resolve_model_dir, "smollm2", settings)
    (served, unserved), env = await model_aliases(settings, model_dir, ["held", "none"])
    tiers = bench_tiers(settings, args.requests + 2)
    env |= tiers_env(tiers)
    settings = settings.model_copy(update={"tiers": tiers})
    key, _ = await create_key(settings, f"bench-busy-{uuid.uuid4().hex[:6]}", HOLD_TIER)
    headers = {"Authorization": f"Bearer {key}"}
    gateway = GatewayProcess(args.log_dir, free_port(), env)
    async with (
        idle_worker(settings, served),
        running([gateway]),
        gateway_client(gateway.port, httpx.Timeout(60)) as http,
    ):
        await asyncio.sleep(2 * settings.backlog_poll_s)  # both models measured
        created = await http.post("/v1/conversations", json={"model": unserved}, headers=headers)
        conversation = created.json()["id"]
        rows = [
            row(
                "refused (503, no worker)",
                await timed(args.requests, lambda: refused(http, headers, conversation)),
            ),
            row("not found (404)", await timed(args.requests, lambda: not_found(http, headers))),
            row(  # fewer than the idle worker's slots: none is refused as busy
                "admitted (to start event)",
                await timed(ADMITTED, lambda: admitted(http, headers, served)),
            ),
        ]
    print("| request | count | p50 ms | p95 ms |\n| --- | --- | --- | --- |")
    print("\n".join(rows))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--log-dir", type=Path, default=Path(".tandoor/bench-logs"))
    return p.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
