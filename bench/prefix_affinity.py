"""Multi-turn prefix caching with two workers: the second turn of a conversation, with
the conversation-to-partition affinity Tandoor uses (the prompt's partition follows its
conversation id, so turn 2 reaches the worker whose prefix cache holds turn 1) beside
random partitions (turn 2 keyed by a fresh id: another worker half the time), in one run.

    python -m bench.prefix_affinity [--conversations 12] [--context-words 400]

The stack (Kafka, Redis) must be up: `tandoor infra up`. Turns are sent one at a time,
so TTFT is the engine's prefill plus the path, not queueing.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import uuid
from dataclasses import dataclass
from pathlib import Path

from bench.machine import describe_machine
from consumers.token_reader import TokenCollector
from infra.roles import WorkerProcess, model_alias, running, with_models
from producers.prompts import PromptSubmitter
from schemas.events import ANSWERED, ChatMessage, FinalEvent, PromptRequest, Sampling, now_ms
from schemas.topics import BandLayout
from tandoor.clients import kafka_producer
from tandoor.settings import Settings
from workers.model_store import resolve_model_dir

BAND = "interactive-paid"
WORDS = "river stone lantern orchard velvet copper meadow harbor ember quartz".split()


@dataclass
class TurnTwo:
    ttft_ms: float
    prompt_tokens: int
    cached_tokens: int


def context(conversation: int, words: int) -> str:
    """A long first message, different for every conversation from its first token."""
    body = " ".join(WORDS[(conversation * 7 + i * 3) % len(WORDS)] for i in range(words))
    return f"Notes {uuid.uuid4().hex}: {body}. Which word comes first?"


async def ask(
    submitter: PromptSubmitter,
    stream: TokenCollector,
    model: str,
    key: str,
    messages: list[ChatMessage],
) -> FinalEvent:
    request = PromptRequest(
        request_id=f"bench-{uuid.uuid4().hex}",
        model=model,
        user_id="bench",
        tier="api",
        band=BAND,
        conversation_id=key,
        messages=messages,
        sampling=Sampling(max_tokens=8, temperature=0.0),
        created_at_ms=now_ms(),
    )
    await submitter.submit(request)
    final = await stream.final(request.request_id, idle_s=300)
    if final.finish_reason not in ANSWERED:
        raise RuntimeError(f"{final.finish_reason}: {final.error}")
    return final


async def conversation(
    submitter: PromptSubmitter,
    stream: TokenCollector,
    model: str,
    number: int,
    words: int,
    affinity: bool,
) -> TurnTwo:
    key = f"conv-{uuid.uuid4().hex}"
    messages = [ChatMessage(role="user", content=context(number, words))]
    first = await ask(submitter, stream, model, key, messages)
    messages += [
        ChatMessage(role="assistant", content=first.text),
        ChatMessage(role="user", content="And which comes last?"),
    ]
    second_key = key if affinity else f"conv-{uuid.uuid4().hex}"
    second = await ask(submitter, stream, model, second_key, messages)
    usage = second.usage
    return TurnTwo(usage.ttft_ms or 0.0, usage.prompt_tokens, usage.cached_tokens)


async def warm_every_partition(
    submitter: PromptSubmitter, stream: TokenCollector, model: str, settings: Settings
) -> None:
    """A prompt to each partition of the band, so to each worker: one warm-up went to one
    worker, and the other's first request, measured, paid vLLM's one-off costs."""
    layout = BandLayout([(band.name, band.partitions) for band in settings.bands])
    cold = set(layout.band(BAND).partitions)
    while cold:
        key = f"warm-{uuid.uuid4().hex}"
        if (partition := layout.partition_for(BAND, key)) in cold:
            await ask(submitter, stream, model, key, [ChatMessage(role="user", content="Hi.")])
            cold.discard(partition)


def report(name: str, turns: list[TurnTwo]) -> str:
    ttft = sorted(t.ttft_ms for t in turns)
    cached = sum(t.cached_tokens for t in turns) / sum(t.prompt_tokens for t in turns)
    hits = sum(t.cached_tokens > 0 for t in turns)
    return (
        f"{name:<22} {statistics.median(ttft):>9.0f} {ttft[int(0.9 * (len(ttft) - 1))]:>9.0f} "
        f"{cached:>9.0%} {hits:>4}/{len(turns)}"
    )


async def run(args: argparse.Namespace) -> None:
    settings = Settings()
    model_dir = await asyncio.to_thread(resolve_model_dir, "smollm2", settings)
    model, env = await model_alias(settings, model_dir, "affinity")
    # Two engines on one machine: vLLM's automatic binding would put both on the same
    # cores (docs/architecture.md); each gets the scheduler's share instead.
    env = with_models(env, max_num_seqs=8, kv_cache_mib=512)
    env |= {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    workers = [WorkerProcess(model, args.log_dir, env) for _ in range(2)]
    async with (
        running(workers),
        kafka_producer(settings, "bench") as producer,
        TokenCollector(settings) as stream,
    ):
        submitter = PromptSubmitter(settings, producer)
        await warm_every_partition(submitter, stream, model, settings)
        results: dict[bool, list[TurnTwo]] = {True: [], False: []}
        for number in range(args.conversations):
            for affinity in (True, False):  # interleaved: drift hits both alike
                turn = await conversation(
                    submitter, stream, model, number, args.context_words, affinity
                )
                results[affinity].append(turn)
    print(f"second turn of {args.conversations} conversations, 2 workers, turn 1 ~"
          f"{args.context_words} words")  # fmt: skip
    print(f"{'partitioning':<22} {'TTFT p50':>9} {'TTFT p90':>9} {'cached':>9} {'hits':>9}")
    print(report("conversation affinity", results[True]))
    print(report("random partitions", results[False]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--context-words", type=int, default=400)
    parser.add_argument("--log-dir", type=Path, default=Path(".tandoor/bench"))
    args = parser.parse_args()
    print(describe_machine(), flush=True)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
