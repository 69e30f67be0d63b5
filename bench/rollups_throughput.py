"""Usage records per second one streams process sustains, and its memory over a million
records: `tandoor streams` reading a usage topic of its own, beside the reference of a
plain aiokafka consumer that only reads and decodes the same records, in one run.

    python -m bench.rollups_throughput [--records 1000000] [--users 1000] [--hours 96]

Kafka and Redis must be up (`tandoor infra up`). The records finish evenly over
`--hours` of record time, so windows open, close and expire as they would in
production (48 windows of each size are kept): memory should rise until the first
hour windows expire (48 h of record time, half the records by default), then stay
flat.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from pathlib import Path

import httpx
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from prometheus_client.parser import text_string_to_metric_families

from bench.machine import describe_machine
from bench.procstats import rss_mib
from infra.process import free_port
from infra.roles import StreamsProcess
from infra.topics import TopicSpec, ensure_topics
from schemas import topics
from schemas.codec import decode, encode
from schemas.events import UsageRecord, now_ms
from tandoor.clients import kafka_producer
from tandoor.settings import Settings

MODELS = ("smollm2", "gemma", "qwen", "llama")
SAMPLE_EVERY_S = 10.0


def record(i: int, count: int, users: int, start_ms: int, span_ms: int) -> UsageRecord:
    return UsageRecord(
        request_id=f"bench-{i}",
        attempt=1,
        user_id=f"user-{i * 7919 % users}",
        tier="plus",
        model=MODELS[i % len(MODELS)],
        prompt_tokens=50 + i % 200,
        completion_tokens=10 + i % 300,
        queue_ms=i % 50,
        ttft_ms=20 + i % 400,
        duration_ms=1000 + i % 3000,
        finish_reason="stop",
        finished_at_ms=start_ms + span_ms * i // count,
    )


async def produce(settings: Settings, topic: str, args: argparse.Namespace) -> float:
    span_ms = int(args.hours * 3_600_000)
    start_ms = now_ms() - span_ms  # ends now: windows close by record time and by clock
    started = time.perf_counter()
    async with kafka_producer(settings, "bench") as producer:
        pending = []
        for i in range(args.records):
            usage = record(i, args.records, args.users, start_ms, span_ms)
            pending.append(await producer.send(topic, encode(usage), key=usage.user_id.encode()))
            if len(pending) >= 10_000:
                await asyncio.gather(*pending)
                pending.clear()
        await asyncio.gather(*pending)
    return float(args.records) / (time.perf_counter() - started)


async def reference(settings: Settings, topic: str, count: int) -> float:
    """Records/s of reading and decoding alone."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.kafka_bootstrap, enable_auto_commit=False
    )
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(topics.USAGE_PARTITIONS)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        started, seen = time.perf_counter(), 0
        while seen < count:
            batch = await consumer.getmany(timeout_ms=1000, max_records=10_000)
            for records in batch.values():
                for r in records:
                    decode(UsageRecord, r.value or b"")
                    seen += 1
        return seen / (time.perf_counter() - started)
    finally:
        await consumer.stop()


async def committed(settings: Settings, group: str, topic: str) -> int:
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    await admin.start()
    try:
        offsets = await admin.list_consumer_group_offsets(group)
        return sum(o.offset for tp, o in offsets.items() if tp.topic == topic and o.offset > 0)
    finally:
        await admin.close()


async def run_streams(
    settings: Settings, topic: str, args: argparse.Namespace
) -> tuple[float, list[str]]:
    app_id = f"streams-bench-{uuid.uuid4().hex[:6]}"
    port = free_port()
    env = {
        "TANDOOR_STREAMS_APP_ID": app_id,
        "TANDOOR_STREAMS_USAGE_TOPIC": topic,
        "TANDOOR_STREAMS_WEB_PORT": str(port),
    }
    app = StreamsProcess(args.log_dir, env)
    app.start()
    lines: list[str] = []
    try:
        await app.wait_ready()
        assert app.proc is not None
        started, done = time.perf_counter(), 0
        while done < args.records:
            await asyncio.sleep(SAMPLE_EVERY_S)
            if not app.alive:
                raise RuntimeError(f"streams exited:\n{app.log()[-3000:]}")
            done = await committed(settings, app_id, topic)
            entries = await table_entries(app)
            elapsed = time.perf_counter() - started
            lines.append(
                f"  {elapsed:6.0f} s  {done:>9,} records  {done / elapsed:7,.0f}/s  "
                f"RSS {rss_mib(app.proc.pid):6.0f} MiB  entries {entries}"
            )
            print(lines[-1], flush=True)
        return args.records / (time.perf_counter() - started), lines
    finally:
        app.terminate()


async def table_entries(app: StreamsProcess) -> dict[str, int]:
    async with httpx.AsyncClient(timeout=10) as http:
        text = (await http.get(f"http://127.0.0.1:{app.ops_port()}/metrics")).text
    return {
        sample.labels["table"]: int(sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "tandoor_streams_table_entries"
    }


async def main_async(args: argparse.Namespace) -> None:
    settings = Settings()
    topic = f"usage-bench-{uuid.uuid4().hex[:6]}"
    await ensure_topics(settings.kafka_bootstrap, [TopicSpec(topic, topics.USAGE_PARTITIONS)])
    produced = await produce(settings, topic, args)
    print(f"produced {args.records:,} usage records at {produced:,.0f}/s", flush=True)
    read = await reference(settings, topic, args.records)
    print(f"reference (aiokafka, read and decode only): {read:,.0f} records/s", flush=True)
    rate, _ = await run_streams(settings, topic, args)
    print(f"{'':<38} {'records/s':>10}")
    print(f"{'aiokafka read + decode (reference)':<38} {read:>10,.0f}")
    print(f"{'tandoor streams (rollups, 1 process)':<38} {rate:>10,.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--users", type=int, default=1_000)
    parser.add_argument("--hours", type=float, default=96.0)
    parser.add_argument("--log-dir", type=Path, default=Path(".tandoor/bench"))
    args = parser.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    print(describe_machine(), flush=True)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
