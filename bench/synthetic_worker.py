"""A worker without an engine, for the token path benchmark: a member of the model's
worker group that answers every prompt with `--events` token events of
`--tokens-per-event` tokens (what the real worker's coalescing sends at full speed) and a
final event, as fast as Kafka takes them, so the gateway's fan-out is what is measured.

    python -m bench.synthetic_worker MODEL [--events 256] [--tokens-per-event 16]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from aiokafka import AIOKafkaConsumer

from schemas.codec import decode
from schemas.events import FinalEvent, PromptRequest, TokenEvent, Usage, now_ms
from schemas.topics import prompts_topic, worker_group
from tandoor.clients import kafka_producer
from tandoor.settings import Settings
from workers.publisher import Publisher

READY = "synthetic worker ready"
WORD = "tok "


async def answer(publisher: Publisher, prompt: PromptRequest, events: int, per_event: int) -> None:
    delta = WORD * per_event
    created = now_ms()
    deliveries = []
    for seq in range(events):
        event = TokenEvent(
            request_id=prompt.request_id,
            attempt=1,
            seq=seq,
            delta=delta,
            token_count=per_event,
            created_at_ms=created,
        )
        deliveries.append(await publisher.token(event, prompt.request_id, prompt.reply_partition))
    await asyncio.gather(*deliveries)
    usage = Usage(prompt_tokens=1, completion_tokens=events * per_event, queue_ms=0, decode_ms=0)
    final = FinalEvent(
        request_id=prompt.request_id,
        attempt=1,
        seq=events,
        finish_reason="length",
        text=delta * events,
        usage=usage,
        model=prompt.model,
        user_id=prompt.user_id,
        tier=prompt.tier,
        conversation_id=prompt.conversation_id,
        created_at_ms=now_ms(),
        prompt_created_at_ms=prompt.created_at_ms,
        store=prompt.store,
    )
    await publisher.final(final, prompt.reply_partition)


async def serve(model: str, events: int, per_event: int) -> None:
    settings = Settings()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    consumer = AIOKafkaConsumer(
        prompts_topic(model),
        bootstrap_servers=settings.kafka_bootstrap,
        group_id=worker_group(model),
        auto_offset_reset="latest",
    )
    tasks: set[asyncio.Task[None]] = set()
    async with kafka_producer(settings, "synthetic-worker") as producer:
        publisher = Publisher(producer)
        await consumer.start()
        try:
            print(f"{READY} for {model}", flush=True)
            while not stop.is_set():
                batch = await consumer.getmany(timeout_ms=200)
                for record in (r for records in batch.values() for r in records):
                    prompt = decode(PromptRequest, record.value)
                    task = asyncio.create_task(answer(publisher, prompt, events, per_event))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
        finally:
            await consumer.stop()
            await asyncio.gather(*tasks, return_exceptions=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--events", type=int, default=256)
    parser.add_argument("--tokens-per-event", type=int, default=16)
    args = parser.parse_args()
    asyncio.run(serve(args.model, args.events, args.tokens_per_event))
    sys.exit(0)


if __name__ == "__main__":
    main()
