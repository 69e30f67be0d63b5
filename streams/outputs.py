"""Where the agents write besides their tables: `usage.rollups`, the by-model topic, and
the tokens-per-minute quota in Redis. Unit tests pass in-memory ones instead."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import faust
from redis.exceptions import RedisError

from schemas.events import UsageRecord
from tandoor.clients import redis_client
from tandoor.policies.quota import Quotas, charged
from tandoor.settings import Settings

log = logging.getLogger(__name__)

Send = Callable[[bytes, bytes], Awaitable[Any]]  # (key, value)


@dataclass
class Outputs:
    rollups: Send  # to usage.rollups
    by_model: Send  # the record again, keyed by model
    settle: Callable[[UsageRecord], Awaitable[None]]  # the quota: stream slot, tokens


def kafka_outputs(settings: Settings, by_model: faust.TopicT, rollups: faust.TopicT) -> Outputs:
    quotas = Quotas(redis_client(settings))

    async def settle(record: UsageRecord) -> None:
        try:
            await settle_quota(quotas, record)
        except RedisError as exc:  # not down but refusing (MISCONF, read-only): counting goes on
            log.warning("quota of %s not settled: %r", record.request_id, exc)

    return Outputs(
        rollups=lambda key, value: rollups.send(key=key, value=value),
        by_model=lambda key, value: by_model.send(key=key, value=value),
        settle=settle,
    )


async def settle_quota(quotas: Quotas, record: UsageRecord) -> None:
    """Free the request's concurrent-stream slot and settle the tokens-per-minute charge
    with the real usage (once per request, whoever comes first: this app, or the gateway
    that followed the reply). A gateway that died mid-reply frees neither: the slot was
    held until its lease ran out, 15 minutes of a free user's only one."""
    if record.charged_tokens and record.charged_at_ms is not None and record.user_id:
        admission = charged(
            record.user_id, record.request_id, record.charged_at_ms, record.charged_tokens
        )
        await quotas.release(admission)
        await quotas.settle(admission, record.prompt_tokens + record.completion_tokens)
