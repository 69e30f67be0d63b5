"""Hostile input costs linear time: checked as a message and streamed as a reply, four
times the text takes about four times as long, not sixteen (quadratic) or forever.

Ratios, not budgets: each size is grown until one check takes long enough to time on
this CPU, and the longer one is compared with it. The checks run in a daemon thread, so
a backtracking regression fails here instead of hanging the suite.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from tandoor.policies.moderation import (
    HOLD_CHARS,
    DefaultModerator,
    StreamRedactor,
    redact_reply,
)

TIMED_AT_LEAST_S = 0.05  # below this, the machine's noise is a large part of a time
LINEAR_AT_MOST = 8.0  # four times the text: ~4x when linear, ~16x when quadratic
GIVE_UP_S = 60.0
# Units repeated into the texts that made a backtracking engine, a recursion or a
# rescan of the held text take seconds or more (tests/unit/test_moderation.py).
HOSTILE_UNITS = ["1", "a.", "12 ", "2024-01-01 ", "x1 ", "0)  9()9(", "john.doe@corp.com-"]


def check_all(text: str) -> None:
    """What every surface does with it: the input check, and the reply as streamed
    (pieces of 7 characters) and as stored."""
    DefaultModerator(["bomb"]).check_input(text + "@")
    redactor = StreamRedactor()
    for i in range(0, len(text), 7):
        redactor.feed(text[i : i + 7])
    redactor.flush()
    redact_reply(text)


def seconds(check: Callable[[str], None], text: str) -> float:
    """The best of three times of `check(text)`; fails if one takes past GIVE_UP_S."""
    return min(timed_once(check, text) for _ in range(3))


def timed_once(check: Callable[[str], None], text: str) -> float:
    took: list[float] = []

    def run() -> None:
        started = time.perf_counter()
        check(text)
        took.append(time.perf_counter() - started)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(GIVE_UP_S)
    assert took, f"{len(text):,} characters took over {GIVE_UP_S:.0f} s"
    return took[0]


@pytest.mark.parametrize("unit", HOSTILE_UNITS)
def test_four_times_the_hostile_text_costs_about_four_times(unit: str) -> None:
    # Past HOLD_CHARS from the start: a stream holds up to that much, each event looking
    # at all of it, so below it the cost grows faster (bounded, as the hold is).
    repeats = 4 * HOLD_CHARS // len(unit) + 1
    while (base := seconds(check_all, unit * repeats)) < TIMED_AT_LEAST_S:
        repeats *= 2
    longer = seconds(check_all, unit * repeats * 4)
    assert longer / base <= LINEAR_AT_MOST, (
        f"{unit!r} x {repeats:,}: {base:.3f} s; x {repeats * 4:,}: {longer:.3f} s"
    )
