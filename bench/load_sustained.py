"""Sustained phase: a fixed rate of short replies from several users over the full
path (gateway, worker with the bundled model, persist) for --minutes, sampling the
roles' RSS and the consumer lag; the first third of the run is the reference for
the last."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass

from bench.chat_load import Outcomes, Turns, make_users, open_loop
from bench.load_stack import FullStack
from bench.procstats import LagProbe, lag_probe, pid_of, rss_mib, tree_rss_mib


@dataclass
class Sample:
    t_s: float
    gateway_mib: float
    worker_mib: float  # the worker process (asyncio, Kafka, detokenizing)
    engine_mib: float  # its children: vLLM's engine core (weights, KV cache)
    persist_mib: float
    worker_lag: int
    persist_lag: int
    replies: int
    errors: int

    FIELDS = (
        "gateway_mib",
        "worker_mib",
        "engine_mib",
        "persist_mib",
        "worker_lag",
        "persist_lag",
    )


async def sample(stack: FullStack, lag: LagProbe, t_s: float, out: Outcomes) -> Sample:
    return Sample(
        t_s,
        rss_mib(pid_of(stack.gateway)),
        rss_mib(pid_of(stack.worker)),
        tree_rss_mib(pid_of(stack.worker)) - rss_mib(pid_of(stack.worker)),
        rss_mib(pid_of(stack.persist)),
        await lag.worker_lag(stack.model),
        await lag.persist_lag(),
        len(out.replies),
        out.errors,
    )


async def sampler(
    stack: FullStack, every_s: float, out: Outcomes, stop: asyncio.Event
) -> list[Sample]:
    samples: list[Sample] = []
    started = time.monotonic()
    async with lag_probe(stack.settings) as lag:
        while True:
            samples.append(await sample(stack, lag, time.monotonic() - started, out))
            if stop.is_set():
                return samples
            next_at = started + len(samples) * every_s
            try:
                await asyncio.wait_for(stop.wait(), max(0.0, next_at - time.monotonic()))
            except TimeoutError:
                continue


def thirds(samples: list[Sample]) -> tuple[list[Sample], list[Sample]]:
    size = max(1, len(samples) // 3)
    return samples[:size], samples[-size:]


def sustained_report(samples: list[Sample], out: Outcomes, started: float) -> str:
    head = (  # worker lag: prompts past the worker group's commits (waiting or in flight)
        f"{'t s':>6}{'gateway MiB':>13}{'worker MiB':>12}{'engine MiB':>12}{'persist MiB':>13}"
        f"{'worker lag':>12}{'persist lag':>13}{'replies':>9}{'errors':>8}"
    )
    lines = ["sustained chat load: samples", head, "-" * len(head)]
    for s in samples:
        lines.append(
            f"{s.t_s:>6.0f}{s.gateway_mib:>13.1f}{s.worker_mib:>12.1f}{s.engine_mib:>12.1f}"
            f"{s.persist_mib:>13.1f}"
            f"{s.worker_lag:>12}{s.persist_lag:>13}{s.replies:>9}{s.errors:>8}"
        )
    first, last = thirds(samples)
    minutes = (statistics.mean(s.t_s for s in last) - statistics.mean(s.t_s for s in first)) / 60
    lines.append("growth, first third -> last third (means):")
    for name in Sample.FIELDS:
        a = statistics.mean(getattr(s, name) for s in first)
        b = statistics.mean(getattr(s, name) for s in last)
        rate = (b - a) / minutes if minutes > 0 else float("nan")
        unit = "MiB" if name.endswith("mib") else "records"
        lines.append(f"  {name:<12} {a:>9.1f} -> {b:>9.1f}  ({rate:+.2f} {unit}/min)")
    end = started + samples[-1].t_s
    span = (end - started) / 3
    early, late = (started, started + span), (end - span, float("inf"))
    lines.append(
        f"replies {len(out.replies)} ok, {out.errors} errors; TTFT p50/p95 "
        f"{out.ttft_ms(50):.0f}/{out.ttft_ms(95):.0f} ms, reply p50/p95 "
        f"{out.total_ms(50):.0f}/{out.total_ms(95):.0f} ms; TTFT p50 first third "
        f"{out.ttft_ms(50, *early):.0f} ms, last third {out.ttft_ms(50, *late):.0f} ms"
    )
    return "\n".join(lines)


async def phase_sustained(stack: FullStack, args: argparse.Namespace) -> None:
    users = await make_users(stack.settings, stack.client, "plus", args.users, stack.model)
    turns = [Turns(user, stack.model, args.turns) for user in users]
    # Unsampled first: the first requests load code and fill pools, which is not growth.
    await open_loop(turns, args.rate, args.warmup_s, args.max_tokens, Outcomes())
    out, stop = Outcomes(), asyncio.Event()
    started = time.monotonic()
    sampling = asyncio.create_task(sampler(stack, args.sample_s, out, stop))
    try:
        await open_loop(turns, args.rate, args.minutes * 60, args.max_tokens, out)
    finally:
        stop.set()
        samples = await sampling
    print(
        f"{args.rate} replies/s of {args.max_tokens} tokens from {args.users} users "
        f"for {args.minutes} min"
    )
    print(sustained_report(samples, out, started))
