"""Where the agents write besides their tables: `usage.rollups`, the by-model topic, and
the tokens-per-minute quota in Redis. Unit tests pass in-memory ones instead."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import faust
from redis.exceptions import RedisError

from schemas.events import UsageRecord
from tandoor.clients import redis_client
from tandoor.policies.quota import Quotas, charged
from tandoor.policies.redis_keys import quota_account
from tandoor.settings import Settings

log = logging.getLogger(__name__)

SETTLE_PAUSE_S = 5.0

Send = Callable[[bytes, bytes], Awaitable[Any]]  # (key, value)


@dataclass
class Outputs:
    rollups: Send  # to usage.rollups
    by_model: Send  # the record again, keyed by model
    settle: Callable[[UsageRecord], Awaitable[None]]  # the quota: stream slot, tokens


def kafka_outputs(settings: Settings, by_model: faust.TopicT, rollups: faust.TopicT) -> Outputs:
    return Outputs(
        rollups=lambda key, value: rollups.send(key=key, value=value),
        by_model=lambda key, value: by_model.send(key=key, value=value),
        settle=Settler(Quotas(redis_client(settings))).settle,
    )


class Settler:
    """Settles each record's quota on the actor that counts every `usage` partition:
    once Redis failed, settling is skipped for SETTLE_PAUSE_S (each record waited out the
    client's timeouts, and the rollups fell behind for as long as Redis was out). What
    is skipped ends by itself: a slot's lease, a minute's window."""

    def __init__(self, quotas: Quotas, clock: Callable[[], float] = time.monotonic) -> None:
        self._quotas, self._clock = quotas, clock
        self._paused_until = 0.0
        self.skipped = 0

    async def settle(self, record: UsageRecord) -> None:
        if self._clock() < self._paused_until:
            self.skipped += 1
            return
        failures = self._quotas.unreachable
        try:
            await settle_quota(self._quotas, record)
        except RedisError as exc:  # answering, but refusing (MISCONF, read-only)
            log.warning("quota of %s not settled: %r", record.request_id, exc)
            failures -= 1
        if self._quotas.unreachable != failures:
            self._paused_until = self._clock() + SETTLE_PAUSE_S


async def settle_quota(quotas: Quotas, record: UsageRecord) -> None:
    """Free the request's concurrent-stream slot and settle the tokens-per-minute charge
    with the real usage (once per request, whoever comes first: this app, or the gateway
    that followed the reply). A gateway that died mid-reply frees neither: the slot was
    held until its lease ran out, 15 minutes of a free user's only one."""
    if record.charged_tokens and record.charged_at_ms is not None and record.user_id:
        account = quota_account(record.user_id, record.tier)
        admission = charged(account, record.request_id, record.charged_at_ms, record.charged_tokens)
        await quotas.release(admission)
        await quotas.settle(admission, record.prompt_tokens + record.completion_tokens)
