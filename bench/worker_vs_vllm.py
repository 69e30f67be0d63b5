"""Worker path (Kafka -> worker -> Kafka) against vLLM's own OpenAI server, same model,
same engine settings, same load, one after the other on this machine.

    python -m bench.worker_vs_vllm [--requests-per-stream 2] [--max-tokens 128]

The stack (Kafka, Redis) must be up: `tandoor infra up`. Prints a table; TTFT is
measured from sending the request to receiving its first token, in both paths.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from pathlib import Path

from bench.loadgen import RunStats, Send, compare, parse_args, question, run_level
from bench.vllm_server import bench_direct
from consumers.token_reader import TokenCollector
from infra.roles import WorkerProcess
from infra.topics import TopicSpec, ensure_topics
from producers.prompts import PromptSubmitter
from schemas import topics
from schemas.events import ChatMessage, PromptRequest, Sampling, now_ms
from tandoor.settings import Settings
from workers.model_store import resolve_model_dir


def worker_sender(
    submitter: PromptSubmitter, stream: TokenCollector, model: str, max_tokens: int
) -> Send:
    async def send(i: int) -> tuple[float, int]:
        request = PromptRequest(
            request_id=f"bench-{uuid.uuid4().hex}",
            model=model,
            user_id="bench",
            tier="api",
            band="interactive-paid",
            conversation_id=f"bench-{i}",
            messages=[ChatMessage(role="user", content=question(i))],
            sampling=Sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            created_at_ms=now_ms(),
        )
        started = time.perf_counter()
        await submitter.submit(request)
        first = await stream.first_token(request.request_id, timeout_s=300)
        ttft = stream.arrival_of(first) - started
        final = await stream.final(request.request_id, timeout_s=300)
        if final.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"{final.finish_reason}: {final.error}")
        return ttft, final.usage.completion_tokens

    return send


async def bench_worker(model_dir: Path, args: argparse.Namespace) -> list[tuple[str, RunStats]]:
    from tandoor.clients import kafka_producer

    settings = Settings()
    model = f"bench-{uuid.uuid4().hex[:6]}"
    partitions = sum(b.partitions for b in settings.bands)
    await ensure_topics(
        settings.kafka_bootstrap, [TopicSpec(topics.prompts_topic(model), partitions)]
    )
    worker = WorkerProcess(
        model,
        args.log_dir,
        {
            "TANDOOR_MODEL_DIRS": json.dumps({model: str(model_dir)}),
            "TANDOOR_WORKER_MAX_SEQS": str(args.max_seqs),
            "TANDOOR_WORKER_KV_CACHE_MIB": str(args.kv_cache_mib),
        },
    )
    worker.start()
    try:
        await worker.wait_ready()
        async with (
            kafka_producer(settings, "bench") as producer,
            TokenCollector(settings) as stream,
        ):
            send = worker_sender(
                PromptSubmitter(settings, producer), stream, model, args.max_tokens
            )
            await run_level(send, 4, 1)  # warm-up
            return [
                ("Tandoor worker via Kafka", await run_level(send, c, args.requests_per_stream))
                for c in args.concurrency
            ]
    finally:
        worker.terminate()


def main() -> None:
    args = parse_args(__doc__)
    model_dir = resolve_model_dir("smollm2", Settings())
    direct = asyncio.run(bench_direct(model_dir, args))
    print(compare(direct, asyncio.run(bench_worker(model_dir, args)), "worker"))


if __name__ == "__main__":
    main()
