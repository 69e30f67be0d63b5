"""Worker path (Kafka -> worker -> Kafka) against vLLM's own OpenAI server, same model,
same engine settings, same load, one after the other on this machine.

    python -m bench.worker_vs_vllm [--requests-per-stream 2] [--max-tokens 128]

The stack (Kafka, Redis) must be up: `tandoor infra up`. Prints a table; TTFT is
measured from sending the request to receiving its first token, in both paths.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from pathlib import Path

from bench.loadgen import (
    RunStats,
    Send,
    alternate,
    measure,
    parse_args,
    question,
    reply_tokens,
)
from bench.machine import describe_machine
from bench.vllm_server import bench_direct, engine_settings
from consumers.token_reader import TokenCollector
from infra.roles import WorkerProcess, model_alias, running, with_models
from producers.prompts import PromptSubmitter
from schemas.events import ANSWERED, ChatMessage, PromptRequest, Sampling, now_ms
from tandoor.clients import kafka_producer
from tandoor.settings import Settings
from workers.model_store import resolve_model_dir


def worker_sender(
    submitter: PromptSubmitter, stream: TokenCollector, model: str, args: argparse.Namespace
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
            # As the direct side's (loadgen.openai_sender): --spread-tokens too.
            sampling=Sampling(
                max_tokens=reply_tokens(i, args.max_tokens, args.spread_tokens),
                temperature=0.0,
                ignore_eos=True,
            ),
            created_at_ms=now_ms(),
        )
        started = time.perf_counter()
        await submitter.submit(request)
        first = await stream.first_text(request.request_id, idle_s=300)  # as the client's
        ttft = stream.arrival_of(first) - started
        final = await stream.final(request.request_id, idle_s=300)
        if final.finish_reason not in ANSWERED:
            raise RuntimeError(f"{final.finish_reason}: {final.error}")
        return ttft, final.usage.completion_tokens

    return send


async def bench_worker(model_dir: Path, args: argparse.Namespace) -> list[tuple[str, RunStats]]:
    settings = Settings()
    model, env = await model_alias(settings, model_dir, "bench")
    env = with_models(env, None, **engine_settings(args))
    async with (
        running([WorkerProcess(model, args.log_dir, env)]),
        kafka_producer(settings, "bench") as producer,
        TokenCollector(settings) as stream,
    ):
        send = worker_sender(PromptSubmitter(settings, producer), stream, model, args)
        return await measure("Tandoor worker via Kafka", send, args)


def main() -> None:
    args = parse_args(__doc__)
    print(describe_machine(), flush=True)
    model_dir = resolve_model_dir("smollm2", Settings())
    alternate(
        args.rounds,
        lambda: asyncio.run(bench_direct(model_dir, args)),
        lambda: asyncio.run(bench_worker(model_dir, args)),
        "worker",
    )


if __name__ == "__main__":
    main()
