"""Load shapes and latency statistics shared by the benchmarks."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.procstats import cpu_snapshot

QUESTIONS = [
    "Explain how a bicycle stays upright.",
    "Describe the water cycle.",
    "Write a short poem about autumn.",
    "What makes bread rise?",
    "Give tips for learning a new language.",
    "How do airplanes fly?",
    "Describe a busy market in the morning.",
    "Why is the sky blue?",
]


Send = Callable[[int], Awaitable[tuple[float, int]]]  # request index -> (ttft_s, tokens)


def question(i: int) -> str:
    return f"{QUESTIONS[i % len(QUESTIONS)]} (request {i})"


@dataclass
class RunStats:
    """One load level against one target."""

    concurrency: int
    ttft_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    errors: int = 0
    wall_s: float = 0.0
    cores: dict[str, float] = field(default_factory=dict)  # CPU seconds per wall second
    counted: dict[str, float] = field(default_factory=dict)  # what a Probe's counters added

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0

    def ttft_ms(self, pct: float) -> float:
        if not self.ttft_s:
            return float("nan")
        if len(self.ttft_s) == 1:
            return self.ttft_s[0] * 1000
        cuts = statistics.quantiles(self.ttft_s, n=100, method="inclusive")
        return cuts[int(pct) - 1] * 1000


def table(rows: list[tuple[str, RunStats]]) -> str:
    head = f"{'target':<28}{'conc':>5}{'reqs':>6}{'err':>5}{'tok/s':>9}{'TTFT p50':>10}{'p95':>9}"
    lines = [head, "-" * len(head)]
    for name, s in rows:
        lines.append(
            f"{name:<28}{s.concurrency:>5}{len(s.ttft_s):>6}{s.errors:>5}"
            f"{s.tokens_per_s:>9.1f}{s.ttft_ms(50):>9.1f}ms{s.ttft_ms(95):>7.1f}ms"
        )
    return "\n".join(lines)


@dataclass
class Probe:
    """What to read around each load level besides the client's view: the CPU each
    process tree used (name -> pid), and counters some role serves (name -> value)."""

    processes: dict[str, int] = field(default_factory=dict)
    counters: Callable[[], Awaitable[dict[str, float]]] | None = None

    async def read(self) -> tuple[dict[str, float], dict[str, float]]:
        counted = await self.counters() if self.counters else {}
        return cpu_snapshot(self.processes), counted


async def run_level(
    send: Send,
    concurrency: int,
    per_stream: int,
    probe: Probe | None = None,
    show_errors: bool = True,
) -> RunStats:
    stats = RunStats(concurrency)
    probe = probe or Probe()
    cpu_before, counted_before = await probe.read()
    counter = iter(range(concurrency * per_stream))

    async def stream() -> None:
        for i in counter:
            try:
                ttft, tokens = await send(i)
                stats.ttft_s.append(ttft)
                stats.output_tokens += tokens
            except Exception as exc:  # counted and shown; the run goes on
                stats.errors += 1
                if show_errors:
                    print(f"  error: {exc!r}", file=sys.stderr)

    started = time.perf_counter()
    await asyncio.gather(*(stream() for _ in range(concurrency)))
    stats.wall_s = time.perf_counter() - started
    cpu_after, counted_after = await probe.read()
    stats.cores = {n: (cpu_after[n] - cpu_before[n]) / stats.wall_s for n in cpu_after}
    stats.counted = {n: counted_after[n] - counted_before.get(n, 0.0) for n in counted_after}
    return stats


def reply_tokens(i: int, max_tokens: int, spread: float) -> int:
    """Request i's length: `max_tokens`, or with `spread` s spread evenly over
    max_tokens x [1 - s, 1 + s] (a golden-ratio sequence: the same for every target), so
    that replies do not all end in the same step."""
    u = (i * 0.6180339887498949) % 1.0
    return max(1, round(max_tokens * (1 - spread + 2 * spread * u)))


def openai_sender(
    client: httpx.AsyncClient,
    base_url: str,
    model: str,
    args: argparse.Namespace,
    key: str = "",
) -> Send:
    """Streams a chat completion the way an OpenAI client does; TTFT is the first content."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    async def send(i: int) -> tuple[float, int]:
        body = {
            "model": model,
            "stream": True,
            "max_tokens": reply_tokens(i, args.max_tokens, args.spread_tokens),
            "temperature": 0,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": question(i)}],
        }
        started = time.perf_counter()
        ttft, tokens = None, 0
        url = f"{base_url}/v1/chat/completions"
        async with client.stream("POST", url, json=body, headers=headers, timeout=300) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:  # a stream ended by an error is no reply
                    raise RuntimeError(f"error chunk: {chunk['error']}")
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                choices = chunk.get("choices") or []
                if ttft is None and choices and choices[0]["delta"].get("content"):
                    ttft = time.perf_counter() - started
        assert ttft is not None, "no content"
        assert tokens, "no usage chunk"
        return ttft, tokens

    return send


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def stop_on_sigterm() -> None:
    """A SIGTERM (gpu_check.sh's `timeout`) ends a run as Ctrl-C does, through its
    clean-ups: Python's default ended it at once, and the vLLM server and the roles, in
    sessions of their own, ran on."""
    signal.signal(signal.SIGTERM, _interrupted)


def parse_args(doc: str | None) -> argparse.Namespace:
    """The side-by-side benchmarks' arguments."""
    stop_on_sigterm()
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--spread-tokens",
        type=float,
        default=0.0,
        help="spread replies' lengths over max-tokens x [1-s, 1+s] (0: all equal, in waves)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run both targets this many times, alternating, and report each round's "
        "ratios and their medians (the machine's speed drifts between runs)",
    )
    parser.add_argument("--max-seqs", type=int, default=32)
    parser.add_argument("--kv-cache-mib", type=int, default=1024)
    parser.add_argument(
        "--vllm-port", type=int, default=0, help="the direct server's port (0: a free one)"
    )
    parser.add_argument("--log-dir", type=Path, default=Path(".tandoor/bench"))
    args = parser.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    return args


def compare(
    direct: list[tuple[str, RunStats]], other: list[tuple[str, RunStats]], name: str
) -> str:
    """The table, both targets side by side per load level, and the ratios."""
    rows = [row for pair in zip(direct, other, strict=True) for row in pair]
    lines = [table(rows)]
    for (_, d), (_, o) in zip(direct, other, strict=True):
        lines.append(
            f"concurrency {d.concurrency}: {name}/direct throughput "
            f"{ratio(o, d):.1%}, TTFT p50 delta "
            f"{o.ttft_ms(50) - d.ttft_ms(50):+.1f} ms, errors {o.errors} vs {d.errors}"
            # A refused or broken request frees its stream for the next: the engine stays
            # as busy, so tokens/s alone would not show the loss.
            + (" (INVALID: errors)" if o.errors or d.errors else "")
        )
    return "\n".join(lines)


Runs = list[tuple[str, RunStats]]


def alternate(
    rounds: int, direct: Callable[[], Runs], other: Callable[[], Runs], name: str
) -> list[tuple[Runs, Runs]]:
    """Both targets `rounds` times, one after the other, each round printed as it ends;
    then each load level's median ratios over the rounds. Every other round runs the
    other target first: a machine's drift over a run favours neither."""
    pairs = []
    for number in range(1, rounds + 1):
        if number % 2:
            pair = direct(), other()
        else:
            second = other()
            pair = direct(), second
        print(f"round {number} of {rounds}\n{compare(*pair, name)}", flush=True)
        pairs.append(pair)
    if rounds > 1:
        print(median_ratios(pairs, name))
    return pairs


def ratio(other: RunStats, direct: RunStats) -> float:
    """Throughput against the direct server's (NaN where it made none: every request
    failed, which took the whole run down with a ZeroDivisionError)."""
    return other.tokens_per_s / direct.tokens_per_s if direct.tokens_per_s else math.nan


def median_ratios(pairs: list[tuple[Runs, Runs]], name: str) -> str:
    """Each level's medians over the rounds without errors (a round with errors is
    INVALID: its refused requests freed their streams, and the median hid it)."""
    lines = []
    for level, (_, first) in enumerate(pairs[0][0]):
        valid = [
            (d[level][1], o[level][1])
            for d, o in pairs
            if not (d[level][1].errors or o[level][1].errors)
        ]
        head = f"concurrency {first.concurrency}, {len(valid)} of {len(pairs)} rounds valid"
        if not valid:
            lines.append(f"{head}: no median (every round had errors)")
            continue
        ratios = [ratio(o, d) for d, o in valid]
        deltas = [o.ttft_ms(50) - d.ttft_ms(50) for d, o in valid]
        lines.append(
            f"{head}: {name}/direct throughput "
            f"median {statistics.median(ratios):.1%} ({', '.join(f'{r:.1%}' for r in ratios)}), "
            f"TTFT p50 delta median {statistics.median(deltas):+.1f} ms "
            f"({', '.join(f'{d:+.1f}' for d in deltas)})"
        )
    return "\n".join(lines)


async def warm_up(send: Send, concurrency: int, tries: int = 30) -> None:
    """Until 4 requests at once all succeed (a worker that just said it is ready may not
    have joined its group yet, and the gateway then answers 503 for seconds), then one
    unmeasured request per stream at `concurrency`: the JVMs on the path (Kafka) compile
    their hot code while serving, which a long-running server has long done, and which
    took 0.04 cores of 2 in the first measured minutes when it was left to the run."""
    for _ in range(tries):
        failed = (await run_level(send, 4, 1, show_errors=False)).errors
        if not failed:
            await run_level(send, concurrency, 1)
            return
        print(f"  warm-up: {failed} of 4 failed (a worker still joining?); again", flush=True)
        await asyncio.sleep(2)
    raise RuntimeError(f"the warm-up still failed after {tries} tries")


async def measure(
    name: str, send: Send, args: argparse.Namespace, probe: Probe | None = None
) -> list[tuple[str, RunStats]]:
    """A warm-up, then every load level of the run."""
    await warm_up(send, max(args.concurrency))
    return [
        (name, await run_level(send, c, args.requests_per_stream, probe)) for c in args.concurrency
    ]


def cpu_table(runs: list[tuple[str, RunStats]]) -> str:
    """Cores each process tree used at each load level (CPU seconds per wall second)."""
    lines = []
    for name, stats in runs:
        if stats.cores:
            used = ", ".join(f"{p} {c:.2f}" for p, c in stats.cores.items())
            total = sum(stats.cores.values())
            lines.append(f"{name} @{stats.concurrency}: cores used {total:.2f} ({used})")
    return "\n".join(lines)
