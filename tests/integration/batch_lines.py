"""What the tests of the batch topic share: lines to send, a tenant's key, the results
read back, and the prompts that reached a model's topic."""

from __future__ import annotations

import json
import uuid
from typing import Any

import orjson
from aiokafka.partitioner import DefaultPartitioner

from producers.batch_topic import ResultsReader, chat_line
from schemas import topics
from tandoor.policies.api_keys import create_key
from tandoor.settings import Settings, TierPolicy
from tests.waiting import IDLE_S, eventually

BACKLOG_PER_WORKER = 16  # the shared worker's slots: lines run as fast as it can
BLOCKED = "zorblax"  # on the moderation blocklist of the roles these tests start


def question(model: str, i: int, max_tokens: int = 4) -> bytes:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"What is {i} + {i}? Reply with the number."}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    return orjson.dumps(chat_line(f"line-{i}", body))


async def batch_key(settings: Settings, name: str) -> tuple[str, str]:
    key, principal = await create_key(settings, f"{name}-{uuid.uuid4().hex[:6]}", "batch")
    return key, principal.user_id


async def all_results(
    reader: ResultsReader, batch_id: str, count: int, idle_s: float = IDLE_S
) -> list[dict[str, Any]]:
    """The batch's results once `count` have come; failing after `idle_s` without one."""

    async def arrived() -> int:
        await reader.poll()
        return len(reader.copies(batch_id))  # copies too: a test counts them

    what = f"{count} results of {batch_id}"
    await eventually(arrived, lambda n: n >= count, what=what, idle_s=idle_s)
    return reader.copies(batch_id)


def answered(result: dict[str, Any]) -> str:
    response = result["response"]
    assert result["error"] is None and response["status_code"] == 200, result
    text = response["body"]["choices"][0]["message"]["content"]
    assert isinstance(text, str)
    return text


def partition_of(batch_id: str) -> int:
    """The partition of `batch.requests` a batch's lines go to (keyed by its id)."""
    every = list(range(topics.BATCH_PARTITIONS))
    return int(DefaultPartitioner()(batch_id.encode(), every, every))


def batch_on_another_partition(prefix: str, than: str) -> str:
    """A fresh batch id whose lines go to another partition than `than`'s."""
    return next(
        b
        for b in (f"{prefix}-{uuid.uuid4().hex[:6]}" for _ in range(100))
        if partition_of(b) != partition_of(than)
    )


async def slow_tenant(
    settings: Settings, roles_env: dict[str, str], max_enqueued_batch_lines: int | None = None
) -> tuple[dict[str, str], str, str]:
    """The roles' environment with a tier of a request a minute, and a key of that tier
    with its owner."""
    slow = TierPolicy(
        band="batch",
        requests_per_minute=1,
        tokens_per_minute=1_000_000,
        concurrent_streams=1,
        max_enqueued_batch_lines=max_enqueued_batch_lines,
    )
    tiers = settings.tiers | {"slow": slow}
    env = roles_env | {
        "TANDOOR_TIERS": json.dumps({name: p.model_dump() for name, p in tiers.items()}),
    }
    key, principal = await create_key(
        settings.model_copy(update={"tiers": tiers}), f"slow-{uuid.uuid4().hex[:6]}", "slow"
    )
    return env, key, principal.user_id
