"""Reading Tandoor's streams from any Kafka client: this example uses nothing but
aiokafka and the json module, no Tandoor code, as an analytics job would.

    python -m consumers.tail usage --from-beginning --limit 5
    python -m consumers.tail usage.rollups
    python -m consumers.tail tokens --bootstrap 127.0.0.1:9092
"""

from __future__ import annotations

import argparse
import asyncio
import os

import orjson
from aiokafka import AIOKafkaConsumer


def describe(topic: str, event: dict[str, object]) -> str:
    if topic == "usage":
        return (
            "{user_id} {model} {finish_reason}: {prompt_tokens}+{completion_tokens} tokens, "
            "ttft {ttft_ms} ms".format(**event)
        )
    if topic == "usage.rollups":
        return "{dimension}={key} {window}@{start_ms}: {requests} requests, {errors} errors".format(
            **event
        )
    if event.get("type") == "token":
        return "{request_id}#{attempt}.{seq} {delta!r}".format(**event)
    return "{request_id}#{attempt} final {finish_reason}: {text!r}".format(**event)


def line_of(topic: str, value: bytes | None) -> str | None:
    """The line shown for a record; None for a tombstone (any client can write one).
    A record of another shape is shown raw, not the end of the tail."""
    if value is None:
        return None
    try:
        return describe(topic, orjson.loads(value))  # nesting past 1024 is a ValueError
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        return f"(not a {topic} event: {exc!r}) {value[:200]!r}"


async def tail(bootstrap: str, topic: str, from_beginning: bool, limit: int | None) -> None:
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=None,  # a reader of its own: commits nothing, disturbs no one
        auto_offset_reset="earliest" if from_beginning else "latest",
    )
    await consumer.start()
    try:
        seen = 0
        async for message in consumer:
            # Flushed per line: piped into another program, a tail must not sit on its output.
            line = line_of(topic, message.value)
            if line is None:
                continue
            print(line, flush=True)
            seen += 1
            if limit is not None and seen >= limit:
                return
    finally:
        await consumer.stop()


def _at_least_one(value: str) -> int:
    count = int(value)
    if count < 1:  # 0 printed one record all the same
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {count}")
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("topic", choices=["tokens", "usage", "usage.rollups"])
    # The stack's own settings, read here without importing Tandoor (a standalone example).
    host, port = os.environ.get("TANDOOR_HOST", "127.0.0.1"), os.environ.get("TANDOOR_KAFKA_PORT")
    broker = f"{host}:{port or 9092}"
    parser.add_argument("--bootstrap", default=broker)
    parser.add_argument("--from-beginning", action="store_true")
    parser.add_argument("--limit", type=_at_least_one, help="stop after this many records")
    args = parser.parse_args()
    asyncio.run(tail(args.bootstrap, args.topic, args.from_beginning, args.limit))


if __name__ == "__main__":
    main()
