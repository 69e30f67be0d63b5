"""The sweep that answers waiting lines of a cancelled batch, or past their batch's
window, at once: their turn may be hours away (a tenant held by its quota, a band
without workers), and their batch shows `cancelling` until every line is answered.

At most ANSWERS_PER_SWEEP a sweep, ANSWERS_AT_ONCE at a time: one after another, a big
batch's answers held every other tenant's lines for minutes. A store failing ends the
sweep (the next one tries again): forwarding goes on meanwhile."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from producers.admission.answers import UNREACHABLE, Unrun, unrun_lines
from producers.admission.marks import LineMarks
from producers.admission.waiting import Waiting
from schemas.events import now_ms

log = logging.getLogger(__name__)

ANSWERS_PER_SWEEP = 256
ANSWERS_AT_ONCE = 32  # well under the Redis client's pool of 100 connections


async def answer_unrunnable(
    lines: list[Waiting],
    marks: LineMarks,
    still_waiting: Callable[[Waiting], bool],
    answer: Callable[[Waiting, Unrun], Awaitable[None]],
) -> tuple[set[str], bool]:
    """The request ids answered, and whether more are due (none failed, more left)."""
    try:
        unrun = await unrun_lines(marks, (line.prompt for line in lines), now_ms())
    except UNREACHABLE as exc:
        log.warning("looking for cancelled or expired lines failed (%r); next sweep", exc)
        return set(), False
    due = [
        (line, why)
        for line in lines
        if (why := unrun.get(line.prompt.request_id)) is not None and still_waiting(line)
    ]
    more, due = len(due) > ANSWERS_PER_SWEEP, due[:ANSWERS_PER_SWEEP]
    at_once = asyncio.Semaphore(ANSWERS_AT_ONCE)

    async def answer_one(line: Waiting, why: Unrun) -> None:
        async with at_once:
            await answer(line, why)

    outcomes = await asyncio.gather(*(answer_one(*d) for d in due), return_exceptions=True)
    answered = set()
    for (line, _), outcome in zip(due, outcomes, strict=True):
        if outcome is None:
            answered.add(line.prompt.request_id)
        elif isinstance(outcome, UNREACHABLE):
            log.warning("answering a cancelled or expired line failed (%r); next sweep", outcome)
        else:
            raise outcome
    return answered, more and len(answered) == len(due)
