"""The usage page's past days are summed once: each ask summed all seven days' rows."""

from __future__ import annotations

import datetime as dt
from typing import Any
from unittest.mock import patch

from producers.gateway.usage import SETTLE_S, DayUsage, PastDays

DAY = dt.date(2026, 12, 1)
DAY_END = dt.datetime(2026, 12, 2, tzinfo=dt.UTC).timestamp()


class Summing:
    def __init__(self) -> None:
        self.asked: list[tuple[str, dt.date]] = []

    async def __call__(self, session: Any, user_id: str, day: dt.date) -> DayUsage:
        self.asked.append((user_id, day))
        return DayUsage(day=day, requests=len(self.asked))


async def test_a_settled_day_is_summed_once_and_today_every_time() -> None:
    past, summing = PastDays(), Summing()
    with patch("producers.gateway.usage.day_usage", summing):
        for _ in range(3):
            await past.usage(None, "u", DAY, DAY_END + SETTLE_S)  # over and settled
        for _ in range(3):
            await past.usage(None, "u", DAY + dt.timedelta(days=1), DAY_END + SETTLE_S)  # today
        late = [await past.usage(None, "v", DAY, DAY_END + 1) for _ in range(2)]  # settling
    assert summing.asked.count(("u", DAY)) == 1
    assert summing.asked.count(("u", DAY + dt.timedelta(days=1))) == 3
    assert [u.requests for u in late] == [5, 6]  # summed again: late replies still come


async def test_the_sums_kept_are_bounded() -> None:
    past, summing = PastDays(size=2), Summing()
    with patch("producers.gateway.usage.day_usage", summing):
        for user in ("a", "b", "c", "a"):
            await past.usage(None, user, DAY, DAY_END + SETTLE_S)
    assert summing.asked == [("a", DAY), ("b", DAY), ("c", DAY), ("a", DAY)]
