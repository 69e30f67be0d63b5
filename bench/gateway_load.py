"""Load on one gateway process and the stack behind it, each figure beside a
reference measured in the same run:

  streams    concurrent SSE reply streams held by ONE gateway process (a model with
             no worker: replies never start, streams stay open on keep-alives):
             RSS and open fds per level, memory per stream, /health latency;
             reference: the same process at 0 streams.
  sustained  --minutes of chat at a fixed rate of short replies from several users
             over the full path (gateway, worker with the bundled model, persist):
             RSS of each role and consumer lag sampled every --sample-s, growth
             from the first to the last third of the run.
  fairness   paid-tier (plus) probes at a steady rate, alone (the reference) and
             during a flood of free-tier users that saturates the worker: TTFT p95
             increase against the 25 % target.

    python -m bench.gateway_load [--phase streams|sustained|fairness|all]
        [--levels 0 250 500 1000 2000] [--minutes 5] [--rate 2] [--probe-s 60] ...

Runs against the servers of the environment (Kafka, Cassandra, Redis must be up:
`tandoor infra up`); it starts its own roles on fresh model names (own topics and
groups) and stops them on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.chat_client import ChatError, ChatUser, ReplyTimes, held_reply
from bench.chat_load import Outcomes, Turns, closed_loop, make_users, open_loop, percentile
from bench.loadgen import question
from bench.procstats import (
    LagProbe,
    lag_probe,
    open_fds,
    pid_of,
    rss_mib,
    start_group_at_end,
    tree_rss_mib,
)
from infra.process import free_port
from infra.roles import GatewayProcess, PersistProcess, WorkerProcess, model_aliases, running
from tandoor.settings import Settings, TierPolicy
from workers.model_store import resolve_model_dir

HOLD_TIER = "hold"  # the streams phase's users: one stream each is far too few
HOLD_S = 6 * 3600  # queue timeout and no-worker grace: nothing ends a held stream
SETTLE_S = 2.0  # after a level is reached, before measuring it
START_WAIT_S = 60.0  # a stream without its start event by then counts as failed
FAIRNESS_TARGET = 0.25
DRAIN_S = 120  # s at most, after the flood, before the second reference
DEFAULT_LEVELS = [0, 250, 500, 1000, 2000]
STREAM_TIMEOUT = httpx.Timeout(60, read=None)  # held streams see a keep-alive per 15 s
REPLY_TIMEOUT = httpx.Timeout(300)


# ---- set-up shared by the phases -------------------------------------------------


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


def health_ms(port: int, count: int) -> list[float]:
    """`count` GET /health one after the other on one kept-alive connection, from a
    thread: the gateway's event-loop responsiveness, not the bench's."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    times = []
    try:
        for _ in range(count):
            started = time.perf_counter()
            conn.request("GET", "/health")
            response = conn.getresponse()
            response.read()
            if response.status != 200:
                raise RuntimeError(f"/health answered {response.status}")
            times.append((time.perf_counter() - started) * 1000)
    finally:
        conn.close()
    return times


# ---- streams ---------------------------------------------------------------------


@dataclass
class Level:
    target: int
    alive: int  # streams open when measured
    failed: int  # so far: refused, or no start event within START_WAIT_S
    rss_mib: float
    fds: int
    health_p50_ms: float
    health_max_ms: float


@dataclass
class Holder:
    users: list[ChatUser]
    model: str
    gateway: GatewayProcess
    opening: asyncio.Semaphore
    held: list[asyncio.Task[None]] = field(default_factory=list)
    failed: int = 0

    async def open_one(self, i: int) -> None:
        """One more stream, counted as failed unless its start event arrives."""
        user = self.users[i % len(self.users)]
        async with self.opening:
            try:
                conversation = await user.conversation(self.model)
            except (ChatError, httpx.HTTPError) as exc:
                return self._failure(exc)
            started = asyncio.Event()
            task = asyncio.create_task(held_reply(user, conversation, question(i), started))
            self.held.append(task)
            waiting = asyncio.create_task(started.wait())
            await asyncio.wait(
                {task, waiting}, timeout=START_WAIT_S, return_when=asyncio.FIRST_COMPLETED
            )
            waiting.cancel()
        if not started.is_set():
            self._failure(task.exception() if task.done() else TimeoutError("no start event"))

    def _failure(self, exc: BaseException | None) -> None:
        self.failed += 1
        if self.failed <= 5:
            print(f"  stream failed: {exc!r}", file=sys.stderr)

    async def measure(self, target: int, probes: int) -> Level:
        await asyncio.sleep(SETTLE_S)
        pid = pid_of(self.gateway)
        try:
            health = await asyncio.to_thread(health_ms, self.gateway.port, probes)
        except (OSError, RuntimeError, http.client.HTTPException) as exc:
            print(f"  /health failed: {exc!r}", file=sys.stderr)
            health = [float("inf")]  # over any limit: the ramp stops here
        alive = sum(not task.done() for task in self.held)
        return Level(
            target,
            alive,
            self.failed,
            rss_mib(pid),
            open_fds(pid),
            percentile(health, 50),
            max(health),
        )

    async def close(self) -> None:
        for task in self.held:
            task.cancel()
        await asyncio.gather(*self.held, return_exceptions=True)


async def warm_up(holder: Holder, count: int) -> None:
    """A few streams opened and closed first: the process's first requests load code
    and fill connection pools, which is not memory per stream. (Their replies are
    still followed inside the gateway: closing a stream is not stopping its reply.)"""
    await asyncio.gather(*(holder.open_one(-1 - i) for i in range(count)))
    await holder.close()
    holder.held.clear()


async def ramp(holder: Holder, args: argparse.Namespace) -> list[Level]:
    """Open streams up to each level in turn, keeping them open, until one fails."""
    await warm_up(holder, args.open_concurrency)
    rows: list[Level] = []
    opened = 0
    for target in sorted(args.levels):
        await asyncio.gather(*(holder.open_one(i) for i in range(opened, target)))
        opened = max(opened, target)
        rows.append(await holder.measure(target, args.health_probes))
        print(f"  {target} streams held", file=sys.stderr)
        if holder.failed or rows[-1].alive < target:
            print(f"stops holding at {target}: streams failed or ended", file=sys.stderr)
            break
        if rows[-1].health_p50_ms > args.health_limit_ms:
            print(f"stops holding at {target}: /health p50 over the limit", file=sys.stderr)
            break
    return rows


def streams_report(rows: list[Level]) -> str:
    base = rows[0]
    head = (
        f"{'streams':>8}{'open':>7}{'failed':>7}{'RSS MiB':>9}{'ΔRSS':>8}{'fds':>7}"
        f"{'health p50':>12}{'max':>9}"
    )
    lines = ["streams held by one gateway process", head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.target:>8}{r.alive:>7}{r.failed:>7}"
            f"{r.rss_mib:>9.1f}{r.rss_mib - base.rss_mib:>+8.1f}"
            f"{r.fds:>7}{r.health_p50_ms:>10.2f}ms{r.health_max_ms:>7.1f}ms"
        )
    if len({r.alive for r in rows}) > 1:
        alive = [r.alive for r in rows]
        fit = statistics.linear_regression(alive, [r.rss_mib for r in rows])
        fds = statistics.linear_regression(alive, [r.fds for r in rows])
        top = rows[-1]
        lines.append(
            f"per stream (least squares over the levels): {fit.slope * 1024:.1f} KiB, "
            f"{fds.slope:.2f} fds; "
            f"{top.alive} streams: {top.rss_mib - base.rss_mib:+.1f} MiB over the "
            f"{base.rss_mib:.1f} MiB at 0, {top.fds - base.fds:+d} fds"
        )
    top = rows[-1]
    lines.append(
        f"/health p50 at {top.alive} streams {top.health_p50_ms:.2f} ms vs "
        f"{base.health_p50_ms:.2f} ms at 0; highest level held: "
        f"{max((r.target for r in rows if r.failed == 0 and r.alive == r.target), default=0)}"
    )
    return "\n".join(lines)


async def phase_streams(args: argparse.Namespace) -> None:
    settings = Settings()
    model_dir = await asyncio.to_thread(resolve_model_dir, "smollm2", settings)
    (model,), env = await model_aliases(settings, model_dir, ["hold"])  # no worker for it
    tiers = bench_tiers(settings, max(args.levels) + 1)
    env |= tiers_env(tiers) | {
        "TANDOOR_GATEWAY_MAX_STREAMS": str(max(args.levels) + 1),
        "TANDOOR_QUEUE_TIMEOUT_S": str(HOLD_S),
        "TANDOOR_NO_WORKER_GRACE_S": str(HOLD_S),
    }
    gateway = GatewayProcess(args.log_dir, free_port(), env)
    async with running([gateway]), gateway_client(gateway.port, STREAM_TIMEOUT) as client:
        bench_settings = settings.model_copy(update={"tiers": tiers})
        users = await make_users(bench_settings, client, HOLD_TIER, args.stream_users, model)
        holder = Holder(users, model, gateway, asyncio.Semaphore(args.open_concurrency))
        try:
            rows = await ramp(holder, args)
        finally:
            await holder.close()
    print(streams_report(rows))


# ---- the full stack: sustained load and fairness -----------------------------------


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
    env |= tiers_env(tiers) | {"TANDOOR_WORKER_MAX_SEQS": str(args.max_seqs)}
    settings = settings.model_copy(
        update={"tiers": tiers, "persist_group": env["TANDOOR_PERSIST_GROUP"]}
    )
    await start_group_at_end(settings, settings.persist_group)  # no replay of `tokens`
    gateway = GatewayProcess(args.log_dir, free_port(), env)
    worker, persist = WorkerProcess(model, args.log_dir, env), PersistProcess(args.log_dir, env)
    async with (
        running([worker, persist, gateway]),
        gateway_client(gateway.port, REPLY_TIMEOUT) as client,
    ):
        yield FullStack(settings, model, gateway, worker, persist, client)


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


@dataclass
class Flood:
    out: Outcomes = field(default_factory=Outcomes)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


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
    stack: FullStack, probes: list[Turns], free: list[ChatUser], args: argparse.Namespace
) -> tuple[Outcomes, Flood, list[int]]:
    """Paid probes while every free user asks again as soon as a reply ends."""
    flood = Flood()
    for user in free:
        turns = Turns(user, stack.model, args.turns)
        flood.tasks.append(
            asyncio.create_task(closed_loop(turns, args.flood_tokens, flood.stop, flood.out))
        )
    async with lag_probe(stack.settings) as lag:
        try:
            await asyncio.sleep(args.flood_warmup_s)  # its backlog builds up first
            backlog = [await lag.worker_lag(stack.model)]
            loaded = await probe(stack, probes, args)
            backlog.append(await lag.worker_lag(stack.model))
        finally:
            flood.stop.set()
            await asyncio.gather(*flood.tasks)
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
    free = await make_users(stack.settings, stack.client, "free", args.flood_users, stack.model)
    probes = [Turns(user, stack.model, args.turns) for user in paid]
    before = await probe(stack, probes, args)
    loaded, flood, backlog = await flooded(stack, probes, free, args)
    after = await probe(stack, probes, args)
    print(
        f"{args.probe_rate} paid probes/s for {args.probe_s} s; flood: {args.flood_users} "
        f"free users, {args.flood_tokens} tokens each reply; worker slots {args.max_seqs}"
    )
    print(fairness_report(Fairness(before, loaded, after, flood, backlog)))


# ---- command line ------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--phase", choices=["streams", "sustained", "fairness", "all"], default="all")
    p.add_argument("--levels", type=int, nargs="+", default=DEFAULT_LEVELS)
    p.add_argument("--stream-users", type=int, default=10)
    p.add_argument("--open-concurrency", type=int, default=32)
    p.add_argument("--health-probes", type=int, default=20)
    p.add_argument("--health-limit-ms", type=float, default=1000.0)
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--rate", type=float, default=2.0, help="replies per second")
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--turns", type=int, default=4, help="replies per conversation")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--sample-s", type=float, default=10.0)
    p.add_argument("--warmup-s", type=float, default=20.0, help="load before sampling")
    p.add_argument("--probe-rate", type=float, default=1.0)
    p.add_argument("--probe-s", type=float, default=60.0)
    p.add_argument("--flood-users", type=int, default=48)
    p.add_argument("--flood-tokens", type=int, default=64)
    p.add_argument("--flood-warmup-s", type=float, default=10.0)
    p.add_argument("--max-seqs", type=int, default=32)
    p.add_argument("--log-dir", type=Path, default=Path(".tandoor/bench"))
    args = p.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    return args


async def run(args: argparse.Namespace) -> None:
    if args.phase in ("streams", "all"):
        await phase_streams(args)
    if args.phase in ("sustained", "fairness", "all"):
        async with full_stack(args) as stack:
            if args.phase in ("sustained", "all"):
                await phase_sustained(stack, args)
            if args.phase in ("fairness", "all"):
                await phase_fairness(stack, args)


def main() -> None:
    asyncio.run(run(parse_args()))


if __name__ == "__main__":
    main()
