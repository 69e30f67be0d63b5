"""The usage page's past days are summed once: each ask summed all seven days' rows.
A day is counted by when its prompts were made, and some finish long after the day:
a batch line waits in the lowest band (up to its 24-hour window), a reply's row waits
while Cassandra is down. Those days are summed again now and then until that is over
(summed once ten minutes after midnight, a day kept its missing rows for good)."""

from __future__ import annotations

import datetime as dt
from typing import Any
from unittest.mock import patch

from producers.gateway.usage import FINAL_AFTER_S, RECHECK_S, DayUsage, PastDays

DAY = dt.date(2026, 12, 1)
DAY_END = dt.datetime(2026, 12, 2, tzinfo=dt.UTC).timestamp()


class Summing:
    def __init__(self) -> None:
        self.asked: list[tuple[str, dt.date]] = []

    async def __call__(self, session: Any, user_id: str, day: dt.date) -> DayUsage:
        self.asked.append((user_id, day))
        return DayUsage(day=day, requests=len(self.asked))


async def test_a_final_day_is_summed_once_and_today_every_time() -> None:
    past, summing = PastDays(), Summing()
    with patch("producers.gateway.usage.day_usage", summing):
        for _ in range(3):
            await past.usage(None, "u", DAY, DAY_END + FINAL_AFTER_S)
        for _ in range(3):
            await past.usage(None, "u", DAY + dt.timedelta(days=1), DAY_END + 1)  # today
    assert summing.asked.count(("u", DAY)) == 1
    assert summing.asked.count(("u", DAY + dt.timedelta(days=1))) == 3


async def test_a_day_just_over_is_summed_again_as_its_late_rows_come() -> None:
    past, summing = PastDays(), Summing()
    just_over = DAY_END + 11 * 60  # a batch line of the day still queued
    with patch("producers.gateway.usage.day_usage", summing):
        first = await past.usage(None, "u", DAY, just_over)
        kept = await past.usage(None, "u", DAY, just_over + RECHECK_S - 1)
        later = await past.usage(None, "u", DAY, just_over + RECHECK_S)
    assert [first.requests, kept.requests, later.requests] == [1, 1, 2]


async def test_the_sums_kept_are_bounded() -> None:
    past, summing = PastDays(size=2), Summing()
    with patch("producers.gateway.usage.day_usage", summing):
        for user in ("a", "b", "c", "a"):
            await past.usage(None, user, DAY, DAY_END + FINAL_AFTER_S)
    assert summing.asked == [("a", DAY), ("b", DAY), ("c", DAY), ("a", DAY)]
