"""Memory of the persistence consumer over many stored replies: does its RSS keep
growing with the replies it has stored (a leak), or level off (warm-up and the
allocator)? The sustained chat phase saw +0.36 MiB/min at 2 replies/s, too few
replies to tell; this feeds one persist process tens of thousands of finals.

    python -m bench.persist_memory [--blocks 10] [--per-block 5000]

Each block produces --per-block final events (unique request ids, chat replies of a
few hundred characters) to `tokens`, waits until the persist group has stored them
all, then samples the process's RSS and the rate (replies stored per second, from the
first send to the last commit, all on this machine's cores). Reference: the first
half of the blocks against the second half of the same run, after the first block
(warm-up), and the slope in KiB per thousand replies. Runs against the servers of the
environment (`tandoor infra up`), never a stack serving users: every persist group
reads `tokens`, so a running persist stores these finals too (rows under bench-only
ids, that no user owns), and lags until it has.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from pathlib import Path

from aiokafka import AIOKafkaProducer

from bench.machine import describe_machine
from bench.procstats import lag_probe, pid_of, rss_mib
from infra.roles import PersistProcess, running
from infra.topics import start_group_at_end
from schemas.codec import encode
from schemas.events import FinalEvent, Usage
from schemas.topics import TOKENS
from tandoor.settings import Settings

TEXT = "A reply of ordinary length, stored as it would be after a chat turn. " * 5
DRAIN_TIMEOUT_S = 300


def final(run: str, n: int) -> FinalEvent:
    now_ms = int(time.time() * 1000)
    return FinalEvent(
        request_id=f"{run}-r{n}",
        attempt=1,
        seq=1,
        finish_reason="stop",
        text=TEXT,
        usage=Usage(prompt_tokens=40, completion_tokens=70, queue_ms=5.0, decode_ms=300.0),
        model="bench-persist",
        user_id=f"{run}-user-{n % 50}",
        tier="free",
        conversation_id=f"{run}-c{n % 500}",
        created_at_ms=now_ms,
        prompt_created_at_ms=now_ms,
    )


async def feed(producer: AIOKafkaProducer, run: str, first: int, count: int) -> None:
    sends = [
        await producer.send(TOKENS, encode(final(run, n)), key=f"{run}-r{n}".encode())
        for n in range(first, first + count)
    ]
    await asyncio.gather(*sends)


async def stored_all(settings: Settings) -> None:
    """Until the persist group has no lag on `tokens`."""
    started = time.monotonic()
    async with lag_probe(settings) as lag:
        while await lag.persist_lag() > 0:
            if time.monotonic() - started > DRAIN_TIMEOUT_S:
                raise TimeoutError("persist did not catch up")
            await asyncio.sleep(0.2)


async def run(args: argparse.Namespace) -> None:
    run_id = f"bench-persist-{uuid.uuid4().hex[:6]}"
    group = f"{run_id}-group"
    settings = Settings().model_copy(update={"persist_group": group})
    await start_group_at_end(settings, group)
    persist = PersistProcess(args.log_dir, {"TANDOOR_PERSIST_GROUP": group})
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap, linger_ms=5)
    await producer.start()
    try:
        async with running([persist]):
            pid = pid_of(persist)
            samples = [(0, rss_mib(pid))]
            print(f"persist pid {pid}: {samples[0][1]:.1f} MiB before any reply")
            for block in range(args.blocks):
                started = time.monotonic()
                await feed(producer, run_id, block * args.per_block, args.per_block)
                await stored_all(settings)
                rate = args.per_block / (time.monotonic() - started)
                stored = (block + 1) * args.per_block
                samples.append((stored, rss_mib(pid)))
                print(f"{stored:>7} replies stored: RSS {samples[-1][1]:7.1f} MiB, {rate:.0f}/s")
    finally:
        await producer.stop()
    print(report(samples))


def report(samples: list[tuple[int, float]]) -> str:
    """Warm-up (the first block), then the steady part: its first half against its
    second, and the slope over all of it."""
    steady = samples[1:]
    half = len(steady) // 2
    first, second = steady[:half], steady[half:]
    slope = statistics.linear_regression([n for n, _ in steady], [m for _, m in steady]).slope

    def mean(part: list[tuple[int, float]]) -> float:
        return statistics.fmean(m for _, m in part)

    return (
        f"warm-up: {samples[0][1]:.1f} -> {samples[1][1]:.1f} MiB over the first "
        f"{samples[1][0]} replies\n"
        f"steady: mean RSS {mean(first):.1f} MiB over replies {first[0][0]}-{first[-1][0]} "
        f"(reference), {mean(second):.1f} MiB over {second[0][0]}-{second[-1][0]}; "
        f"slope {slope * 1024 * 1000:+.1f} KiB per 1k replies"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--blocks", type=int, default=10)
    p.add_argument("--per-block", type=int, default=5000)
    p.add_argument("--log-dir", type=Path, default=Path(".tandoor/bench"))
    args = p.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    print(describe_machine(), flush=True)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
