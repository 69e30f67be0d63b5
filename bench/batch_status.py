"""What reading a batch costs the Batches API (GET /v1/batches/{id}, and each batch on a
page of GET /v1/batches), for a finished batch of many lines, beside the reference in
the same run against the same Cassandra:

  counted     every line's answer read and counted (the reference: how each read was
              made before counts were kept, and still how an unfinished batch is read)
  kept        the counts kept on the batch's row once final (BatchService.retrieve)

    python -m bench.batch_status [--lines 50000] [--reads 10]

Runs against the servers of the environment (`tandoor infra up`, `tandoor bootstrap`);
the batch it writes is deleted again.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from cassandra.concurrent import execute_concurrent_with_args

from bench.machine import describe_machine
from consumers.history import INSERT_BATCH_OUTPUT, batch_output_row
from producers.gateway.batches.records import StoredBatch
from producers.gateway.batches.service import BatchService
from tandoor.clients import cassandra_session
from tandoor.policies.api_keys import Principal
from tandoor.settings import Settings

NO_KAFKA: Any = None  # reads and stores only: no batch is queued

WRITTEN_US = 1_796_000_000_000_000


def write_batch(session: object, batch: StoredBatch) -> None:
    insert = session.prepare(INSERT_BATCH_OUTPUT)  # type: ignore[attr-defined]
    rows = []
    for i in range(batch.total):
        status = 200 if i % 10 else 400
        output = {"custom_id": f"line-{i:06d}", "response": {"status_code": status, "body": {}}}
        row = batch_output_row(
            batch.user_id, batch.batch_id, output, WRITTEN_US, WRITTEN_US // 1000
        )
        rows.append(row)
    execute_concurrent_with_args(session, insert, rows, concurrency=64)


async def timed(reads: int, read: Callable[[], Awaitable[object]]) -> list[float]:
    seconds = []
    for _ in range(reads):
        started = time.perf_counter()
        await read()
        seconds.append(time.perf_counter() - started)
    return seconds


def row(name: str, seconds: list[float]) -> str:
    p50, worst = statistics.median(seconds) * 1000, max(seconds) * 1000
    return f"| {name} | {len(seconds)} | {p50:.1f} | {worst:.1f} |"


async def main(args: argparse.Namespace) -> None:
    settings = Settings()
    print(describe_machine(settings))
    user, batch_id = f"bench-{uuid.uuid4().hex[:6]}", f"batch_bench_{uuid.uuid4().hex}"
    created = dt.datetime.now(dt.UTC).replace(tzinfo=None)
    batch = StoredBatch(
        batch_id, user, "f", "/v1/chat/completions", "24h", args.lines, None, created, None
    )
    caller = Principal(user, "batch", "bench")
    with cassandra_session(settings, settings.keyspace) as session:
        service = BatchService(session, make_producer=NO_KAFKA, redis=None)
        await service.batches.create(batch)
        started = time.perf_counter()
        write_batch(session, batch)
        print(f"{args.lines} output rows written in {time.perf_counter() - started:.1f} s")
        try:
            counted = await timed(args.reads, lambda: service.batches.answered(user, batch_id))
            first = await timed(1, lambda: service.retrieve(caller, batch_id))
            kept = await timed(args.reads, lambda: service.retrieve(caller, batch_id))
            shown = await service.retrieve(caller, batch_id)
        finally:
            session.execute(
                "DELETE FROM batch_outputs WHERE user_id = %s AND batch_id = %s", (user, batch_id)
            )
            await service.batches.delete(batch)
    print(f"status {shown['status']}, counts {shown['request_counts']}")
    print("| read of a finished batch | reads | p50 ms | max ms |\n| --- | --- | --- | --- |")
    print(row("counted, every line (reference)", counted))
    print(row("retrieve, first (counts, then keeps them)", first))
    print(row("retrieve, counts kept", kept))
    print(f"kept / counted: {statistics.median(counted) / statistics.median(kept):.0f}x faster")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--lines", type=int, default=50_000)
    p.add_argument("--reads", type=int, default=10)
    return p.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
