"""The Cassandra write time of a stored reply: later attempts win, a replay changes
nothing, two different finals of one attempt do not share a time, and of those the one
that keeps more of the reply wins."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from consumers.history import write_timestamp_us
from schemas.events import FinalEvent
from tests.unit.test_rollups import final_event


def run(attempt: int, text: str, reason: str = "stop") -> FinalEvent:
    return final_event("r", attempt).model_copy(update={"text": text, "finish_reason": reason})


@given(st.integers(1, 9), st.text(max_size=40), st.text(max_size=40))
def test_a_later_attempt_is_written_later_whatever_its_text(
    attempt: int, text: str, later_text: str
) -> None:
    assert write_timestamp_us(run(attempt + 1, later_text)) > write_timestamp_us(run(attempt, text))


def test_a_replay_has_the_same_time_and_two_runs_of_one_attempt_do_not() -> None:
    assert write_timestamp_us(run(1, "zz")) == write_timestamp_us(run(1, "zz"))
    assert write_timestamp_us(run(1, "zz")) != write_timestamp_us(run(1, "aa bb cc"))
    assert write_timestamp_us(run(1, "zz")) != write_timestamp_us(run(1, "zz", "cancelled"))


@given(st.integers(1, 9), st.text(min_size=1, max_size=40), st.sampled_from(["stop", "length"]))
def test_a_finished_reply_outranks_an_empty_rerun_of_its_attempt(
    attempt: int, text: str, reason: str
) -> None:
    """Redis down: a second worker ran the same attempt after the deadline and answered
    "expired" without text; the finished reply is what stays stored."""
    finished = write_timestamp_us(run(attempt, text, reason))
    for empty in ("expired", "cancelled", "error"):
        assert finished > write_timestamp_us(run(attempt, "", empty)), empty
    assert finished > write_timestamp_us(run(attempt, text[:-1] or "x", "cancelled"))
    assert finished < write_timestamp_us(run(attempt + 1, "", "expired"))


def test_a_partial_reply_outranks_an_empty_one_and_an_error_a_silent_end() -> None:
    partial = write_timestamp_us(run(1, "The moon is", "cancelled"))
    assert partial > write_timestamp_us(run(1, "", "error"))
    assert write_timestamp_us(run(1, "", "error")) > write_timestamp_us(run(1, "", "expired"))
