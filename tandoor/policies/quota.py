"""Quotas in Redis, checked and charged in one atomic step before anything reaches
Kafka: requests per minute, tokens per minute, concurrent streams. Each is counted per
account: a user in the tier of the key the request came with (redis_keys.quota_account),
held to that tier's limits.

Requests per minute slide: a log of the last minute's requests, so no burst fits
across a minute's boundary. Tokens per minute are fixed windows (keys expire with their
window), charged with an estimate at admission and settled with the real usage later.
A stream holds a slot until it is released (by the gateway that follows it, or by the
streams app when the request's usage record arrives, so a gateway that died mid-reply
does not hold it), or until its lease runs out.

When Redis is down, each tier follows its `redis_down` policy (tandoor/settings.py):

- "open" (plus and api by default: paying interactive users keep chatting): the
  request is served without being counted. Requests and tokens per minute are not
  enforced during the outage and not charged afterwards; concurrent streams still are,
  per gateway replica, from memory (so a user gets at most limit x replicas).
- "closed" (free and batch): a 503 with Retry-After (QuotaUnavailable), before
  anything is written. Abuse of the cheap tiers is what the limits are for.

Settling and releasing never fail a request: a slot that Redis could not free runs out
with its lease, a settlement that could not be made leaves the estimate charged.
Once Redis answers again every tier is counted again, from where Redis left off.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Literal, cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tandoor.clients import REDIS_DOWN
from tandoor.policies.redis_keys import (
    requests_log_key,
    settled_key,
    streams_key,
    tokens_window_key,
)
from tandoor.settings import TierPolicy

log = logging.getLogger(__name__)

REDIS_DOWN_RETRY_S = 5  # fail-closed tiers: when to try again
WINDOW_MS = 60_000
STREAM_LEASE_MS = 15 * 60_000  # a stream longer than this no longer counts
BUSY_RETRY_MS = 1_000  # all stream slots taken: try again soon

ADMIT = """
local now, window_end = tonumber(ARGV[1]), tonumber(ARGV[2])
local rpm, tpm, streams = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local tokens, request_id, lease = tonumber(ARGV[6]), ARGV[7], tonumber(ARGV[8])
local minute, holds_stream = tonumber(ARGV[10]), ARGV[11] == '1'
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - minute)
local charged_at = redis.call('ZSCORE', KEYS[1], request_id)
if charged_at then  -- the same request again (a retry, a replay): charged once
  return {1, 'ok', 0, tonumber(charged_at)}
end
if holds_stream and redis.call('ZCARD', KEYS[3]) >= streams then
  return {0, 'concurrent_streams', tonumber(ARGV[9])}
end
if redis.call('ZCARD', KEYS[1]) >= rpm then
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return {0, 'requests_per_minute', tonumber(oldest[2]) + minute - now}
end
if tonumber(redis.call('GET', KEYS[2]) or '0') + tokens > tpm then
  return {0, 'tokens_per_minute', window_end - now}
end
redis.call('ZADD', KEYS[1], now, request_id)
redis.call('PEXPIRE', KEYS[1], minute)
redis.call('INCRBY', KEYS[2], tokens)
-- By the caller's clock plus a minute: a host behind Redis set an expiry already past
-- (the minute's count dropped), one ahead a too early one, for every host's charges.
redis.call('PEXPIRE', KEYS[2], window_end - now + minute)
if holds_stream then
  redis.call('ZADD', KEYS[3], now + lease, request_id)
  redis.call('PEXPIRE', KEYS[3], lease)
end
return {1, 'ok', 0, now}
"""

# Once per request (the gateway and the streams app may both try): adjust the admission
# window's token count by (actual - estimate), if the window still exists.
SETTLE = """
if not redis.call('SET', KEYS[2], '1', 'NX', 'PX', ARGV[2]) then
  return 0
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  return redis.call('INCRBY', KEYS[1], ARGV[1])
end
return 0
"""
SETTLED_TTL_MS = 2 * WINDOW_MS  # past this the window's key is gone anyway

Limit = Literal["requests_per_minute", "tokens_per_minute", "concurrent_streams"]


@dataclass(frozen=True)
class Admission:
    """A charged request: what to settle and release when it ends."""

    account: str  # redis_keys.quota_account: the user, in the tier it was charged in
    request_id: str
    window_start_ms: int
    estimated_tokens: int
    counted: bool = True  # False: admitted while Redis was down (nothing to settle there)
    charged_at_ms: int = 0  # when it was charged (the first time, for a request again)


@dataclass(frozen=True)
class QuotaUse:
    """How much of each limit a user holds right now (the usage page)."""

    requests: int  # in the sliding minute
    tokens: int  # charged in the current fixed minute window (estimates until settled)
    streams: int  # open, their leases not run out


class QuotaUnavailable(Exception):
    """Redis is down and the tier fails closed."""

    retry_after_s = REDIS_DOWN_RETRY_S

    def __init__(self, tier_band: str) -> None:
        super().__init__(f"quotas cannot be checked right now ({tier_band} fails closed)")


class QuotaExceeded(Exception):
    def __init__(self, limit: Limit, retry_after_ms: int) -> None:
        super().__init__(f"{limit.replace('_', ' ')} quota exceeded")
        self.limit = limit
        self.retry_after_s = max(1, -(-retry_after_ms // 1000))  # whole seconds, rounded up


def charged(account: str, request_id: str, charged_at_ms: int, tokens: int) -> Admission:
    """The admission a usage record describes, for settling it from the usage stream."""
    return Admission(account, request_id, charged_at_ms - charged_at_ms % WINDOW_MS, tokens)


class Quotas:
    def __init__(self, client: aioredis.Redis) -> None:
        self._redis = client
        self._admit = client.register_script(ADMIT)
        self._settle = client.register_script(SETTLE)
        self._uncounted: Counter[str] = Counter()  # streams admitted while Redis was down
        self.unreachable = 0  # settlements and releases Redis could not take

    async def admit(
        self,
        account: str,
        policy: TierPolicy,
        request_id: str,
        tokens: int,
        now_ms: int,
        holds_stream: bool = True,
    ) -> Admission:
        """Charge one request and `tokens` estimated tokens, or raise QuotaExceeded.
        A batch line streams to nobody: it takes no concurrent-stream slot. The same
        request id within the minute is charged once (admission retries a line whose
        produce failed, and replays one after a crash)."""
        window = now_ms - now_ms % WINDOW_MS
        keys = [
            requests_log_key(account),
            tokens_window_key(account, window),
            streams_key(account),
        ]
        args: list[int | str] = [
            now_ms,
            window + WINDOW_MS,
            policy.requests_per_minute,
            policy.tokens_per_minute,
            policy.concurrent_streams,
            tokens,
            request_id,
            STREAM_LEASE_MS,
            BUSY_RETRY_MS,
            WINDOW_MS,
            int(holds_stream),
        ]
        try:
            allowed, limit, retry_ms, *charged_at = await self._admit(keys=keys, args=args)
        except REDIS_DOWN as exc:
            log.warning("quotas unreachable (%s): %s fails %s", exc, account, policy.redis_down)
            return self._uncounted_admission(
                account, policy, request_id, tokens, holds_stream, now_ms
            )
        if not allowed:
            name = limit.decode() if isinstance(limit, bytes) else str(limit)
            raise QuotaExceeded(cast(Limit, name), int(retry_ms))
        charged_ms = int(charged_at[0])
        window_start = charged_ms - charged_ms % WINDOW_MS
        return Admission(account, request_id, window_start, tokens, charged_at_ms=charged_ms)

    def _uncounted_admission(
        self,
        account: str,
        policy: TierPolicy,
        request_id: str,
        tokens: int,
        holds_stream: bool,
        now_ms: int,
    ) -> Admission:
        if policy.redis_down == "closed":
            raise QuotaUnavailable(policy.band)
        if holds_stream:
            if self._uncounted[account] >= policy.concurrent_streams:
                raise QuotaExceeded("concurrent_streams", BUSY_RETRY_MS)
            self._uncounted[account] += 1
        return Admission(account, request_id, 0, tokens, counted=False, charged_at_ms=now_ms)

    async def in_use(self, account: str, now_ms: int) -> QuotaUse | None:
        """What `admit` would count now; None while Redis is unreachable."""
        window = now_ms - now_ms % WINDOW_MS
        pipe = self._redis.pipeline(transaction=False)
        pipe.zcount(requests_log_key(account), f"({now_ms - WINDOW_MS}", "+inf")
        pipe.get(tokens_window_key(account, window))
        pipe.zcount(streams_key(account), f"({now_ms}", "+inf")
        try:
            requests, tokens, streams = await pipe.execute()
        except (*REDIS_DOWN, RedisError) as exc:  # read-only in a failover too: unknown
            log.warning("quota use of %s unknown, Redis unreachable (%s)", account, exc)
            return None
        return QuotaUse(int(requests), int(tokens or 0), int(streams))

    async def settle(self, admission: Admission, actual_tokens: int) -> None:
        """Replace the estimate with the real usage in the window it was charged to;
        only the first settlement of a request counts."""
        if not admission.counted:
            return
        keys = [
            tokens_window_key(admission.account, admission.window_start_ms),
            settled_key(admission.request_id),
        ]
        delta = actual_tokens - admission.estimated_tokens
        try:
            await self._settle(keys=keys, args=[delta, SETTLED_TTL_MS])
        except REDIS_DOWN as exc:
            self.unreachable += 1
            log.warning("%s: not settled, Redis unreachable (%s)", admission.request_id, exc)

    async def refund(self, admission: Admission) -> None:
        """A request refused after it was charged (Cassandra or Kafka down): it counts
        against no limit, its slot freed and its place in the minute's requests too."""
        await self.settle(admission, 0)
        await self.release(admission)
        if admission.counted:
            try:
                await self._redis.zrem(requests_log_key(admission.account), admission.request_id)
            except REDIS_DOWN as exc:
                log.warning("%s: still counted this minute (%s)", admission.request_id, exc)

    async def release(self, admission: Admission) -> None:
        """The stream ended: free its concurrent-stream slot."""
        if not admission.counted:
            self._uncounted[admission.account] -= 1
            if self._uncounted[admission.account] <= 0:
                del self._uncounted[admission.account]
            return
        try:
            await self._redis.zrem(streams_key(admission.account), admission.request_id)
        except REDIS_DOWN as exc:  # the slot's lease frees it later
            self.unreachable += 1
            log.warning("%s: slot not released, Redis unreachable (%s)", admission.request_id, exc)
