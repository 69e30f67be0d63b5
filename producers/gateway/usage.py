"""GET /v1/usage: the caller's own usage, for the page's usage view.

Requests and tokens per UTC day come from `usage_by_user_day`, which the persistence
consumer writes from the final events on `tokens` (one row per finished request, so a
replay does not count twice); what each per-minute limit holds right now comes from the
quota keys in Redis that admission charges. Nothing here takes a user id: a key sees its own user.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import math
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel

from producers.gateway.auth import Caller
from producers.gateway.json_body import StrictJsonRoute
from producers.gateway.services import Services, services
from tandoor.clients import cql
from tandoor.policies.quota import QuotaUse
from tandoor.settings import TierPolicy

DAYS = 7
PAST_DAYS_KEPT = 60_000  # (user, day) sums a replica keeps, about 10 MB
# A day's rows are those of prompts made that day; some are stored much later (a batch
# line waits in the lowest band up to its 24-hour window; persistence waits out a
# Cassandra outage). Until FINAL_AFTER_S past its end, a day's sum is kept RECHECK_S.
FINAL_AFTER_S = 2 * 86_400.0
RECHECK_S = 600.0
# Summed by Cassandra within the day's partition: one row back however busy the day.
SELECT_DAY = (
    "SELECT count(*) AS requests, sum(CAST(prompt_tokens AS bigint)) AS prompt, "
    "sum(CAST(completion_tokens AS bigint)) AS completion "
    "FROM usage_by_user_day WHERE user_id = %s AND day = %s"
)

router = APIRouter(prefix="/v1", tags=["usage"], route_class=StrictJsonRoute)


class DayUsage(BaseModel):
    day: dt.date
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class Limit(BaseModel):
    limit: int
    used: int | None  # None: the quota store is unreachable right now


class Limits(BaseModel):
    requests_per_minute: Limit
    tokens_per_minute: Limit
    concurrent_streams: Limit


class Usage(BaseModel):
    tier: str
    days: list[DayUsage]  # the last 7 UTC days, oldest first; the last one is today
    today: DayUsage
    last_7_days: DayUsage  # `day` is the first of the seven
    limits: Limits


class PastDays:
    """Days over are summed once a replica (for a while, then for good, as above): the
    page asks every 10 s, and each ask summed all seven days' rows (a busy api-tier user
    writes close to a million a day)."""

    def __init__(self, size: int = PAST_DAYS_KEPT) -> None:
        self._sums: dict[tuple[str, dt.date], tuple[DayUsage, float]] = {}  # sum, kept until
        self._size = size

    async def usage(self, session: Any, user_id: str, day: dt.date, now: float) -> DayUsage:
        kept = self._sums.get((user_id, day))
        if kept is not None and now < kept[1]:
            return kept[0]
        summed = await day_usage(session, user_id, day)
        day_end = dt.datetime.combine(day + dt.timedelta(days=1), dt.time(), dt.UTC).timestamp()
        if now >= day_end:
            final = now >= day_end + FINAL_AFTER_S
            self._keep((user_id, day), summed, math.inf if final else now + RECHECK_S)
        return summed

    def _keep(self, key: tuple[str, dt.date], summed: DayUsage, until: float) -> None:
        self._sums.pop(key, None)
        if len(self._sums) >= self._size:
            del self._sums[next(iter(self._sums))]  # the oldest kept
        self._sums[key] = (summed, until)


PAST_DAYS = PastDays()  # this replica's


async def day_usage(session: Any, user_id: str, day: dt.date) -> DayUsage:
    (row,) = await cql(session, SELECT_DAY, (user_id, day))
    prompt, completion = row.prompt or 0, row.completion or 0
    return DayUsage(
        day=day,
        requests=row.requests,
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
    )


def summed(days: list[DayUsage]) -> DayUsage:
    return DayUsage(
        day=days[0].day,
        requests=sum(d.requests for d in days),
        prompt_tokens=sum(d.prompt_tokens for d in days),
        completion_tokens=sum(d.completion_tokens for d in days),
        total_tokens=sum(d.total_tokens for d in days),
    )


def limits(policy: TierPolicy, use: QuotaUse | None) -> Limits:
    def used(field: str) -> int | None:
        return None if use is None else int(getattr(use, field))

    return Limits(
        requests_per_minute=Limit(limit=policy.requests_per_minute, used=used("requests")),
        tokens_per_minute=Limit(limit=policy.tokens_per_minute, used=used("tokens")),
        concurrent_streams=Limit(limit=policy.concurrent_streams, used=used("streams")),
    )


@router.get("/usage")
async def usage(caller: Caller, deps: Annotated[Services, Depends(services)]) -> Usage:
    """The caller's requests and tokens per day over the last 7 days, its tier's
    per-minute limits and how much of each it holds now."""
    now = time.time()
    today = dt.datetime.fromtimestamp(now, dt.UTC).date()
    first = today - dt.timedelta(days=DAYS - 1)
    session = deps.session
    past = PAST_DAYS
    days, use = await asyncio.gather(
        asyncio.gather(
            *(
                past.usage(session, caller.user_id, first + dt.timedelta(days=i), now)
                for i in range(DAYS)
            )
        ),
        deps.chat.deps.quotas.in_use(caller.quota_account, int(now * 1000)),
    )
    policy = deps.settings.tiers[caller.tier]
    return Usage(
        tier=caller.tier,
        days=list(days),
        today=days[-1],
        last_7_days=summed(list(days)),
        limits=limits(policy, use),
    )
