"""Streams phase: concurrent SSE reply streams held by ONE gateway process.

The model's only worker takes nothing (infra/idle_worker.py), so replies never start
and streams stay open on keep-alives; the queue timeout and no-worker grace are raised
so nothing ends them.
At each level: the gateway's RSS and open fds, and /health latency; the reference
is the same process at 0 streams, after a warm-up."""

from __future__ import annotations

import argparse
import asyncio
import http.client
import statistics
import sys
import time
from dataclasses import dataclass, field

import httpx

from bench.chat_client import ChatError, ChatUser, held_reply
from bench.chat_load import make_users, percentile
from bench.load_stack import HOLD_TIER, bench_tiers, gateway_client, tiers_env
from bench.loadgen import question
from bench.procstats import open_fds, pid_of, rss_mib
from infra.idle_worker import idle_worker
from infra.process import free_port
from infra.roles import GatewayProcess, model_aliases, running
from tandoor.settings import Settings
from workers.model_store import resolve_model_dir

HOLD_S = 6 * 3600  # queue timeout and no-worker grace: nothing ends a held stream
SETTLE_S = 2.0  # after a level is reached, before measuring it
START_WAIT_S = 60.0  # a stream without its start event by then counts as failed
STREAM_TIMEOUT = httpx.Timeout(60, read=None)  # held streams see a keep-alive per 15 s


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
    (model,), env = await model_aliases(settings, model_dir, ["hold"])
    tiers = bench_tiers(settings, max(args.levels) + 1)
    env |= tiers_env(tiers) | {
        "TANDOOR_GATEWAY_MAX_STREAMS": str(max(args.levels) + 1),
        "TANDOOR_QUEUE_TIMEOUT_S": str(HOLD_S),
        "TANDOOR_NO_WORKER_GRACE_S": str(HOLD_S),
    }
    gateway = GatewayProcess(args.log_dir, free_port(), env)
    async with (
        idle_worker(settings, model),
        running([gateway]),
        gateway_client(gateway.port, STREAM_TIMEOUT) as client,
    ):
        bench_settings = settings.model_copy(update={"tiers": tiers})
        users = await make_users(bench_settings, client, HOLD_TIER, args.stream_users, model)
        holder = Holder(users, model, gateway, asyncio.Semaphore(args.open_concurrency))
        try:
            rows = await ramp(holder, args)
        finally:
            await holder.close()
    print(streams_report(rows))
