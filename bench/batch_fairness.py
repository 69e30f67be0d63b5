"""Tenant fairness in the batch band: one tenant floods `batch.requests` with thousands
of lines, another then submits a small batch. How long the small batch takes, beside
its time alone, under the admission role's Virtual Token Counter and under the
reference, first-come first-served (TANDOOR_ADMISSION_FAIRNESS=fifo), in one run; and
each tenant's share of the tokens served over time.

    python -m bench.batch_fairness [--flood 2000] [--small 20] [--max-tokens 8]

Kafka, Cassandra and Redis must be up (`tandoor infra up`). One worker serves a model
of its own; admission and persist run in groups of their own. Target: the small batch
within 2x its time alone.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from bench.machine import describe_machine
from infra.roles import (
    AdmissionProcess,
    PersistProcess,
    WorkerProcess,
    model_alias,
    running,
)
from infra.topics import batch_request_partitions, start_group_at_end
from producers.batch_topic import ResultsReader, chat_line, send_lines
from tandoor.clients import kafka_producer
from tandoor.policies.api_keys import create_key
from tandoor.settings import Settings
from workers.model_store import resolve_model_dir

SHARE_EVERY_S = 5.0


@dataclass
class Run:
    name: str
    small_s: float | None = None  # None: not done within the cap
    small_done: int = 0
    shares: list[str] = field(default_factory=list)


def lines(model: str, count: int, max_tokens: int) -> list[bytes]:
    return [
        orjson.dumps(
            chat_line(
                f"q{i}",
                {
                    "model": model,
                    "messages": [{"role": "user", "content": f"Name a colour ({i})."}],
                    "max_tokens": max_tokens,
                    "ignore_eos": True,  # every line the same work: shares compare tokens
                },
            )
        )
        for i in range(count)
    ]


def tokens(results: list[dict[str, Any]]) -> int:
    return sum(
        r["response"]["body"]["usage"]["total_tokens"]
        for r in results
        if r["response"] and r["response"]["status_code"] == 200
    )


async def one_run(
    settings: Settings,
    args: argparse.Namespace,
    model: str,
    env: dict[str, str],
    fairness: str,
    flood: int,
    cap_s: float | None,
) -> Run:
    tag = uuid.uuid4().hex[:6]
    env = {
        **env,
        "TANDOOR_ADMISSION_GROUP": f"admission-bench-{tag}",
        "TANDOOR_PERSIST_GROUP": f"persist-bench-{tag}",
        "TANDOOR_ADMISSION_FAIRNESS": fairness,
    }
    await start_group_at_end(settings, env["TANDOOR_PERSIST_GROUP"])
    await start_group_at_end(settings, env["TANDOOR_ADMISSION_GROUP"], batch_request_partitions())
    flood_key, _ = await create_key(settings, f"flood-{tag}", "batch")
    small_key, _ = await create_key(settings, f"small-{tag}", "batch")
    flood_id, small_id = f"flood-{tag}", f"small-{tag}"
    run = Run(f"{fairness}, {flood}-line flood" if flood else "small batch alone")
    reader = ResultsReader(settings.kafka_bootstrap)
    await reader.start()
    try:
        async with (
            kafka_producer(settings, "bench") as producer,
            running([AdmissionProcess(args.log_dir, env), PersistProcess(args.log_dir, env)]),
        ):
            if flood:
                await send_lines(
                    producer, flood_key, flood_id, lines(model, flood, args.max_tokens)
                )
                while len(reader.of(flood_id)) < 8:  # the flood is being served
                    await reader.poll()
            started = time.monotonic()
            await send_lines(
                producer, small_key, small_id, lines(model, args.small, args.max_tokens)
            )
            window_start, served = started, (0, 0)
            while len(reader.of(small_id)) < args.small:
                await reader.poll()
                now = time.monotonic()
                if cap_s is not None and now - started > cap_s:
                    break
                if now - window_start >= SHARE_EVERY_S:
                    totals = (tokens(reader.of(flood_id)), tokens(reader.of(small_id)))
                    run.shares.append(share_line(now - started, totals, served))
                    window_start, served = now, totals
            run.small_done = len(reader.of(small_id))
            if run.small_done >= args.small:
                run.small_s = time.monotonic() - started
    finally:
        await reader.stop()
    return run


def share_line(at_s: float, totals: tuple[int, int], before: tuple[int, int]) -> str:
    flood, small = totals[0] - before[0], totals[1] - before[1]
    whole = max(1, flood + small)
    shares = f"flood {flood / whole:4.0%}  small {small / whole:4.0%}"
    return f"  t={at_s:5.0f} s  {shares}  ({whole} tokens)"


async def main_async(args: argparse.Namespace) -> None:
    settings = Settings()
    model_dir = await asyncio.to_thread(resolve_model_dir, "smollm2", settings)
    model, env = await model_alias(settings, model_dir, "fairness")
    async with running([WorkerProcess(model, args.log_dir, env)]):
        alone = await one_run(settings, args, model, env, "vtc", 0, None)
        assert alone.small_s is not None
        fair = await one_run(settings, args, model, env, "vtc", args.flood, None)
        fifo = await one_run(settings, args, model, env, "fifo", args.flood, 5 * alone.small_s)
    sizes = f"small batch: {args.small} lines; flood: {args.flood} lines"
    print(f"{sizes}; {args.max_tokens} tokens a line")
    print(f"{'run':<28} {'small batch':>14} {'vs alone':>9}")
    for run in (alone, fair, fifo):
        if run.small_s is None:
            took = f"{run.small_done}/{args.small} in {5 * alone.small_s:.0f} s"
            print(f"{run.name:<28} {took:>14} {'> 5x':>9}")
        else:
            print(f"{run.name:<28} {run.small_s:>12.1f} s {run.small_s / alone.small_s:>8.2f}x")
    for run in (fair, fifo):
        print(f"served-token share while the small batch ran ({run.name}):")
        print("\n".join(run.shares) or "  (under one window)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--flood", type=int, default=2000)
    parser.add_argument("--small", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--log-dir", type=Path, default=Path(".tandoor/bench"))
    args = parser.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    print(describe_machine(), flush=True)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
