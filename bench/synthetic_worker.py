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

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from schemas import topics
from schemas.codec import decode, encode
from schemas.events import FinalEvent, PromptRequest, TokenEvent, Usage, now_ms
from schemas.topics import prompts_topic, worker_group
from tandoor.clients import kafka_producer
from tandoor.settings import Settings
from workers.publisher import Publisher

READY = "synthetic worker ready"
WORD = "tok "
Shape = tuple[int, int]  # events per reply, tokens per event


async def answer(
    producer: AIOKafkaProducer, publisher: Publisher, prompt: PromptRequest, shape: Shape
) -> None:
    """The token events as whole Kafka batches (about 60 events each), then the final
    through the worker's own publisher. Sent one by one as the worker does, the events
    cost this stand-in half a core, taken from the gateway it measures on 2 cores."""
    events, per_event = shape
    delta = WORD * per_event
    created = now_ms()
    key = prompt.request_id.encode()
    partition = prompt.reply_partition
    assert partition is not None, "the gateway names a reply partition"
    batch = producer.create_batch()
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
        if batch.append(key=key, value=encode(event), timestamp=None) is None:
            deliveries.append(await producer.send_batch(batch, topics.TOKENS, partition=partition))
            batch = producer.create_batch()
            batch.append(key=key, value=encode(event), timestamp=None)
    deliveries.append(await producer.send_batch(batch, topics.TOKENS, partition=partition))
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
    await publisher.final(final, partition)


def _answered(task: asyncio.Task[None]) -> None:
    """A reply that failed is said: its client waits for it until its silence limit."""
    if not task.cancelled() and task.exception() is not None:
        print(f"synthetic worker: a reply failed: {task.exception()!r}", file=sys.stderr)


async def serve(model: str, shape: Shape) -> None:
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
    batches = AIOKafkaProducer(  # idempotent: a batch sent again is not written twice
        bootstrap_servers=settings.kafka_bootstrap, acks="all", enable_idempotence=True
    )
    async with kafka_producer(settings, "synthetic-worker") as producer, batches:
        publisher = Publisher(producer)
        await consumer.start()
        try:
            print(f"{READY} for {model}", flush=True)
            while not stop.is_set():
                batch = await consumer.getmany(timeout_ms=200)
                for record in (r for records in batch.values() for r in records):
                    prompt = decode(PromptRequest, record.value)
                    task = asyncio.create_task(answer(batches, publisher, prompt, shape))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    task.add_done_callback(_answered)
        finally:
            await consumer.stop()
            await asyncio.gather(*tasks, return_exceptions=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--events", type=int, default=256)
    parser.add_argument("--tokens-per-event", type=int, default=16)
    args = parser.parse_args()
    asyncio.run(serve(args.model, (args.events, args.tokens_per_event)))
    sys.exit(0)


if __name__ == "__main__":
    main()
