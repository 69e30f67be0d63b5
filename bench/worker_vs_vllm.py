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
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

from bench.loadgen import RunStats, question, table
from consumers.token_reader import TokenCollector
from infra.roles import WorkerProcess
from infra.topics import TopicSpec, ensure_topics
from producers.prompts import PromptSubmitter
from schemas import topics
from schemas.events import ChatMessage, PromptRequest, Sampling, now_ms
from tandoor.settings import Settings
from workers.model_store import resolve_model_dir

Send = Callable[[int], Awaitable[tuple[float, int]]]  # request index -> (ttft_s, tokens)


async def run_level(send: Send, concurrency: int, per_stream: int) -> RunStats:
    stats = RunStats(concurrency)
    counter = iter(range(concurrency * per_stream))

    async def stream() -> None:
        for i in counter:
            try:
                ttft, tokens = await send(i)
                stats.ttft_s.append(ttft)
                stats.output_tokens += tokens
            except Exception as exc:  # counted and shown; the run goes on
                stats.errors += 1
                print(f"  error: {exc!r}", file=sys.stderr)

    started = time.perf_counter()
    await asyncio.gather(*(stream() for _ in range(concurrency)))
    stats.wall_s = time.perf_counter() - started
    return stats


# --- vLLM's own OpenAI server -------------------------------------------------------


def start_vllm_server(
    model_dir: Path, port: int, args: argparse.Namespace
) -> subprocess.Popen[bytes]:
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        "smollm2",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "2048",
        "--enforce-eager",
        "--enable-prefix-caching",
        "--max-num-seqs",
        str(args.max_seqs),
        "--kv-cache-memory-bytes",
        str(args.kv_cache_mib * 1024 * 1024),
    ]
    log = open(args.log_dir / "vllm-server.log", "wb")
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


async def wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError("vLLM server exited during start-up")
            try:
                if (await client.get(url)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"{url} not ready in {timeout_s} s")


def direct_sender(client: httpx.AsyncClient, port: int, max_tokens: int) -> Send:
    async def send(i: int) -> tuple[float, int]:
        body = {
            "model": "smollm2",
            "stream": True,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": question(i)}],
        }
        started = time.perf_counter()
        ttft, tokens = None, 0
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        async with client.stream("POST", url, json=body, timeout=300) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                choices = chunk.get("choices") or []
                if ttft is None and choices and choices[0]["delta"].get("content"):
                    ttft = time.perf_counter() - started
        assert ttft is not None, "no content"
        return ttft, tokens

    return send


async def bench_direct(model_dir: Path, args: argparse.Namespace) -> list[tuple[str, RunStats]]:
    port = args.vllm_port
    proc = start_vllm_server(model_dir, port, args)
    try:
        await wait_http(f"http://127.0.0.1:{port}/health", proc)
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
            send = direct_sender(client, port, args.max_tokens)
            await run_level(send, 4, 1)  # warm-up
            return [
                ("vLLM OpenAI server", await run_level(send, c, args.requests_per_stream))
                for c in args.concurrency
            ]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


# --- Tandoor worker ------------------------------------------------------------------


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
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-seqs", type=int, default=32)
    parser.add_argument("--kv-cache-mib", type=int, default=1024)
    parser.add_argument("--vllm-port", type=int, default=18765)
    parser.add_argument("--log-dir", type=Path, default=Path(".tandoor/bench"))
    args = parser.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    settings = Settings()
    model_dir = resolve_model_dir("smollm2", settings)
    direct = asyncio.run(bench_direct(model_dir, args))
    via_worker = asyncio.run(bench_worker(model_dir, args))
    rows = [row for pair in zip(direct, via_worker, strict=True) for row in pair]
    print(table(rows))
    for (_, d), (_, w) in zip(direct, via_worker, strict=True):
        print(
            f"concurrency {d.concurrency}: worker/direct throughput "
            f"{w.tokens_per_s / d.tokens_per_s:.1%}, TTFT p50 delta "
            f"{w.ttft_ms(50) - d.ttft_ms(50):+.1f} ms"
        )


if __name__ == "__main__":
    main()
