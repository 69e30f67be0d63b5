from __future__ import annotations

import pytest

from workers.coalesce import OPENING_EVENTS, Coalescer
from workers.scheduler import BandScheduler

BANDS = ["paid", "free", "batch"]


def test_higher_band_is_served_first() -> None:
    scheduler = BandScheduler(BANDS, reserve=0.1)
    assert scheduler.plan(3, {"paid": 5, "batch": 100}) == {"paid": 3}


def test_idle_higher_bands_leave_slots_to_lower_ones() -> None:
    scheduler = BandScheduler(BANDS)
    assert scheduler.plan(4, {"free": 1, "batch": 100}) == {"free": 1, "batch": 3}


def test_a_flooded_lower_band_keeps_its_reserved_share() -> None:
    scheduler = BandScheduler(BANDS, reserve=0.1)
    served = {"paid": 0, "batch": 0}
    for _ in range(100):  # one slot at a time, paid always has work
        for band, n in scheduler.plan(1, {"paid": 1000, "batch": 1000}).items():
            served[band] += n
    assert served["batch"] == pytest.approx(9, abs=1)  # about one in eleven
    assert served["paid"] == 100 - served["batch"]


def test_no_backlog_no_plan() -> None:
    assert BandScheduler(BANDS).plan(8, {}) == {}


def test_reserve_is_validated() -> None:
    with pytest.raises(ValueError, match="reserve"):
        BandScheduler(BANDS, reserve=1.5)


def test_lower_bands_never_take_the_slots_kept_for_the_top_band() -> None:
    scheduler = BandScheduler(BANDS, reserve=0.1, max_slots=8, kept_for_top=2)
    assert scheduler.plan(8, {"free": 100, "batch": 100}) == {"free": 6}
    held = {"free": 5, "batch": 1}  # the lower bands' 6 slots are taken
    assert scheduler.plan(2, {"free": 100, "batch": 100}, held) == {}
    assert scheduler.lower_headroom(held) == 0
    assert scheduler.plan(2, {"paid": 1, "free": 100}, held) == {"paid": 1}
    assert scheduler.plan(2, {"free": 100}, {"free": 5}) == {"free": 1}


def test_without_kept_slots_lower_bands_may_take_all() -> None:
    scheduler = BandScheduler(BANDS, max_slots=8)
    assert scheduler.lower_headroom({"free": 8}) is None
    assert scheduler.plan(8, {"free": 100}, {"free": 0}) == {"free": 8}


def test_kept_slots_are_validated() -> None:
    with pytest.raises(ValueError, match="kept_for_top"):
        BandScheduler(BANDS, max_slots=4, kept_for_top=5)


def test_deltas_go_at_once_until_the_first_word_ends_then_are_coalesced() -> None:
    c = Coalescer(window_s=0.010, max_tokens=100)
    assert c.add("Cert", 1, now=0.000) == ("Cert", 1)
    assert c.add("ainly", 1, now=0.001) == ("ainly", 1), "the first word is not over"
    assert c.add("!", 1, now=0.002) == ("!", 1)
    assert c.add(" Here", 1, now=0.003) == (" Here", 1), "the space ends the first word"
    assert c.add(" is", 1, now=0.004) is None
    assert c.add(",", 1, now=0.006) is None
    assert c.add(" world", 1, now=0.014) == (" is, world", 3)
    assert c.flush(now=0.015) is None


def test_a_reply_without_spaces_is_coalesced_after_a_few_events() -> None:
    c = Coalescer(window_s=1.0, max_tokens=100)
    sent = [c.add("x", 1, now=i / 1000) for i in range(OPENING_EVENTS + 3)]
    assert sent[:OPENING_EVENTS] == [("x", 1)] * OPENING_EVENTS
    assert sent[OPENING_EVENTS:] == [None] * 3


def test_token_cap_flushes_before_the_window() -> None:
    c = Coalescer(window_s=1.0, max_tokens=3)
    c.add("a ", 1, now=0.0)
    assert c.add("b", 1, now=0.1) is None
    assert c.add("c", 2, now=0.2) == ("bc", 3)


def test_final_flush_returns_the_rest() -> None:
    c = Coalescer(window_s=1.0, max_tokens=100)
    c.add("a ", 1, now=0.0)
    c.add("🙂", 1, now=0.1)
    assert c.flush(now=0.2) == ("🙂", 1)
