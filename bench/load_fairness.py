"""Fairness phase: paid-tier (plus) probes at a steady rate, alone (the reference,
before and after) and during a flood of free-tier users that saturates the worker;
TTFT p95 increase against the 25 % target, each TTFT split into where it went."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson

from bench.chat_client import ReplyTimes
from bench.chat_load import Outcomes, Turns, make_users, open_loop
from bench.load_stack import FullStack
from bench.procstats import LagProbe, lag_probe

FAIRNESS_TARGET = 0.25
DRAIN_S = 120  # s at most, after the flood, before the second reference
FLOOD_START_S = 120  # s for the flood client to create its users


@dataclass
class Flood:
    """The free users' client: its own process (bench/flood_client.py), niced."""

    process: asyncio.subprocess.Process
    out: Outcomes = field(default_factory=Outcomes)

    @classmethod
    async def start(cls, stack: FullStack, args: argparse.Namespace) -> Flood:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            *("-m", "bench.flood_client", "--port", str(stack.gateway.port)),
            *("--model", stack.model, "--users", str(args.flood_users)),
            *("--tokens", str(args.flood_tokens), "--turns", str(args.turns)),
            stdout=asyncio.subprocess.PIPE,
        )
        flood = cls(process)
        assert process.stdout is not None
        ready = await asyncio.wait_for(process.stdout.readline(), FLOOD_START_S)
        if ready.strip() != b"ready":
            await flood.kill()
            raise RuntimeError(f"the flood client did not start (rc {process.returncode})")
        return flood

    async def stop(self) -> None:
        """SIGTERM; its replies in flight end, then it reports what it got."""
        self.process.send_signal(signal.SIGTERM)
        assert self.process.stdout is not None
        report = orjson.loads(await self.process.stdout.read())
        await self.process.wait()
        self.out.errors = report["errors"]
        self.out.replies = [(row[0], ReplyTimes(*row[1:])) for row in report["replies"]]

    async def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()
            await self.process.wait()


async def probe(stack: FullStack, probes: list[Turns], args: argparse.Namespace) -> Outcomes:
    out = Outcomes()
    await open_loop(probes, args.probe_rate, args.probe_s, args.max_tokens, out)
    return out


PARTS: list[tuple[str, Callable[[ReplyTimes], float]]] = [
    ("queue", lambda t: t.queue_s),  # gateway produced it -> engine has it
    ("engine", lambda t: t.worker_ttft_s - t.queue_s),  # -> first token (prefill in the batch)
    ("rest", lambda t: t.ttft_s - t.worker_ttft_s),  # gateway before producing + way back
]


@dataclass
class Fairness:
    before: Outcomes  # paid probes alone, before the flood
    loaded: Outcomes  # paid probes during the flood
    after: Outcomes  # paid probes alone again, once the flood's backlog is done
    flood: Flood
    backlog: list[int]  # the worker's, as the loaded probes start and end

    @property
    def alone(self) -> Outcomes:
        """The reference: both alone windows pooled, so a noisy one weighs less."""
        return Outcomes(self.before.replies + self.after.replies, self.before.errors)


def fairness_report(f: Fairness) -> str:
    parts = "".join(f"{name + ' p50/p95':>17}" for name, _ in PARTS)
    head = f"{'condition':<24}{'replies':>8}{'errors':>7}{'TTFT p50/p95':>17}{parts}"
    lines = ["fairness: paid-tier TTFT, alone and during a free-tier flood", head, "-" * len(head)]
    rows = [
        ("paid alone, before", f.before),
        ("paid alone, after", f.after),
        ("paid alone (reference)", f.alone),
        ("paid during free flood", f.loaded),
        ("free flood", f.flood.out),
    ]
    for name, o in rows:
        cells = [(o.ttft_ms(50), o.ttft_ms(95))]
        cells += [(o.part_ms(50, part), o.part_ms(95, part)) for _, part in PARTS]
        shown = "".join(f"{f'{a:.0f}/{b:.0f} ms':>17}" for a, b in cells)
        lines.append(f"{name:<24}{len(o.replies):>8}{o.errors:>7}{shown}")
    lines.append(
        "queue: the gateway produced the prompt -> the worker's engine has it; engine: -> "
        "its first token; rest: the gateway's work before producing, and the way back"
    )
    lines.append(
        f"worker backlog (waiting + in flight) during the flood: {min(f.backlog)}-{max(f.backlog)}"
    )
    p50 = f.loaded.ttft_ms(50) / f.alone.ttft_ms(50) - 1
    p95 = f.loaded.ttft_ms(95) / f.alone.ttft_ms(95) - 1
    verdict = "met" if p95 <= FAIRNESS_TARGET else "NOT met"
    lines.append(
        f"paid TTFT under the flood: p95 {p95:+.0%} (target <= +{FAIRNESS_TARGET:.0%}): "
        f"{verdict}; p50 {p50:+.0%}"
    )
    drift = abs(f.after.ttft_ms(95) / f.before.ttft_ms(95) - 1)
    if drift > FAIRNESS_TARGET:
        lines.append(
            f"warning: the two alone windows' p95 differ by {drift:.0%}: the machine's own "
            "noise is above the target, so a figure near the target proves nothing"
        )
    return "\n".join(lines)


async def flooded(
    stack: FullStack, probes: list[Turns], args: argparse.Namespace
) -> tuple[Outcomes, Flood, list[int]]:
    """Paid probes while every free user asks again as soon as a reply ends."""
    flood = await Flood.start(stack, args)
    async with lag_probe(stack.settings) as lag:
        try:
            await asyncio.sleep(args.flood_warmup_s)  # its backlog builds up first
            backlog = [await lag.worker_lag(stack.model)]
            loaded = await probe(stack, probes, args)
            backlog.append(await lag.worker_lag(stack.model))
            await flood.stop()
        finally:
            await flood.kill()
        await drained(lag, stack.model)
    return loaded, flood, backlog


async def drained(lag: LagProbe, model: str) -> None:
    """Wait (a while) for what the flood left: title jobs in the batch band."""
    for _ in range(DRAIN_S):  # polled: the backlog lives in Kafka, nothing signals it
        if await lag.worker_lag(model) == 0:
            return
        await asyncio.sleep(1)


async def phase_fairness(stack: FullStack, args: argparse.Namespace) -> None:
    paid = await make_users(stack.settings, stack.client, "plus", 2, stack.model)
    probes = [Turns(user, stack.model, args.turns) for user in paid]
    before = await probe(stack, probes, args)
    loaded, flood, backlog = await flooded(stack, probes, args)
    after = await probe(stack, probes, args)
    print(
        f"{args.probe_rate} paid probes/s for {args.probe_s} s; flood: {args.flood_users} "
        f"free users, {args.flood_tokens} tokens each reply; worker slots {args.max_seqs}"
    )
    print(fairness_report(Fairness(before, loaded, after, flood, backlog)))
