"""What recording a token event in the request's transcript costs the worker
(workers/ledger.py: one Lua script under the lease, awaited before the event is sent),
beside references in the same run against the same Redis:

  record      RequestLedger.record: lease check, gap check, RPUSH, expiries
  set         a plain SET of the same bytes (the cheapest awaited round trip)
  send only   the producer's send of a token event without waiting for delivery
              (what the worker did per event before transcripts)

    python -m bench.transcript_record [--events 5000] [--streams 32]

`streams` requests record concurrently, as a worker's running requests do. Runs
against the servers of the environment (`tandoor infra up`).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable

from bench.machine import describe_machine
from schemas import topics
from schemas.codec import encode
from schemas.events import TokenEvent, now_ms
from tandoor.clients import kafka_producer, redis_client
from tandoor.settings import Settings
from workers.ledger import Arrival, Recorded, RequestLedger

DELTA = " a few words"  # about 3 tokens: one coalesced event


async def per_stream(
    streams: int, events: int, one: Callable[[int, int], Awaitable[object]]
) -> tuple[float, list[float]]:
    """Events per second over `streams` concurrent streams, and each call's latency."""
    latencies: list[float] = []

    async def stream(index: int) -> None:
        for seq in range(events // streams):
            started = time.perf_counter()
            await one(index, seq)
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(stream(i) for i in range(streams)))
    return len(latencies) / (time.perf_counter() - started), latencies


def row(name: str, rate: float, latencies: list[float]) -> str:
    p50 = statistics.median(latencies) * 1000
    p99 = statistics.quantiles(latencies, n=100)[98] * 1000
    return f"| {name} | {rate:,.0f} | {p50:.2f} | {p99:.2f} |"


async def main(args: argparse.Namespace) -> None:
    settings = Settings()
    print(describe_machine(settings))
    redis = redis_client(settings)
    ledger = RequestLedger(redis, f"bench-{uuid.uuid4().hex[:6]}", lease_s=60)
    ids = [f"bench_{uuid.uuid4().hex}" for _ in range(args.streams)]
    for request_id in ids:
        assert isinstance(await ledger.arrive(request_id), Arrival)
    raw = Recorded(1, 0, DELTA, 3).encode()

    async def record(index: int, seq: int) -> object:
        return await ledger.record(ids[index], 1, Recorded(1, seq, DELTA, 3))

    async def plain_set(index: int, seq: int) -> object:
        return await redis.set(f"{ids[index]}:{seq}", raw, ex=60)

    async with kafka_producer(settings, "bench-transcript") as producer:

        async def send_only(index: int, seq: int) -> object:
            event = TokenEvent(
                request_id=ids[index],
                attempt=1,
                seq=seq,
                delta=DELTA,
                token_count=3,
                created_at_ms=now_ms(),
            )
            return await producer.send(topics.TOKENS, encode(event), key=ids[index].encode())

        rows = [
            row("record (transcript)", *await per_stream(args.streams, args.events, record)),
            row("set (reference)", *await per_stream(args.streams, args.events, plain_set)),
            row("send only (reference)", *await per_stream(args.streams, args.events, send_only)),
        ]
        await producer.flush()
    for request_id in ids:
        await ledger.forget_transcript(request_id, 1)
        await ledger.release(request_id)
    await redis.aclose()
    print(f"{args.events} events over {args.streams} concurrent streams")
    print("| per event | events/s | p50 ms | p99 ms |\n| --- | --- | --- | --- |")
    print("\n".join(rows))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--events", type=int, default=5000)
    p.add_argument("--streams", type=int, default=32)
    return p.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
