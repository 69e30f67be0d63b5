"""Which turns a summary stands in for, and which still go into the context."""

from __future__ import annotations

import datetime as dt
from types import SimpleNamespace

from producers.gateway.chat.history import after_summary, left_out_for_good
from producers.gateway.conversations.protocol import ConversationWithMessages, Message
from producers.gateway.conversations.service import (
    SUMMARY_WRITTEN_WITHIN_S,
    summary_stale_by_times,
)

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def message(n: int, role: str, status: str = "complete") -> Message:
    return Message(
        id=f"m{n}",
        role=role,
        content=f"text {n}",
        status="sent" if role == "user" else status,
        created_at=T0 + dt.timedelta(seconds=n),
    )


def opened(summary: str | None, until: int | None, stale: bool = False) -> ConversationWithMessages:
    return ConversationWithMessages(
        id="c",
        model="m",
        title=None,
        created_at=T0,
        updated_at=T0,
        messages=[
            message(1, "user"),
            message(2, "assistant"),
            message(3, "user"),
            message(4, "assistant", status="replaced"),
            message(5, "assistant"),
        ],
        summary=summary,
        summary_until=None if until is None else T0 + dt.timedelta(seconds=until),
        summary_stale=stale,
    )


def test_without_a_summary_every_shown_turn_counts() -> None:
    summary, turns = after_summary(opened(None, None))
    assert summary is None and [m.id for m in turns] == ["m1", "m2", "m3", "m5"]


def test_a_summary_stands_in_for_the_turns_it_covers() -> None:
    summary, turns = after_summary(opened("They said hello.", until=2))
    assert summary == "They said hello." and [m.id for m in turns] == ["m3", "m5"]


def test_a_summary_of_turns_an_edit_replaced_is_not_used() -> None:
    """The user edited a summarized turn (to take a name or a number out): the summary
    still told the model what it said. Every shown turn goes in instead."""
    stale = opened("They gave their card number.", until=4, stale=True)  # m4 replaced since
    summary, turns = after_summary(stale)
    assert summary is None and [m.id for m in turns] == ["m1", "m2", "m3", "m5"]


def row(at: int, status: str, status_written: int) -> SimpleNamespace:
    created = T0 + dt.timedelta(seconds=at)
    return SimpleNamespace(created_at=created, status=status, status_written=status_written)


def test_a_summary_is_stale_only_if_a_turn_it_covers_may_have_been_replaced_since_its_read() -> (
    None
):
    """Any replaced turn it covered made it stale: a reply regenerated long before the
    summary was made (never in it) left every later summary unused, for good (each new
    one covered that turn too), and the model forgot what the chat had said. A turn
    replaced in the time its job may have run (read, then the model's answer, then the
    write) may be in it: stale."""
    written = 10_000_000_000
    window = int(SUMMARY_WRITTEN_WITHIN_S * 1_000_000)
    summary = SimpleNamespace(summary_until=T0 + dt.timedelta(seconds=4), summary_written=written)
    regenerated_before = [row(2, "replaced", written - window - 1), row(3, "complete", 1)]
    assert not summary_stale_by_times(summary, regenerated_before)
    for edited in (written - window + 1, written - 1, written + 1):  # while it ran, or since
        assert summary_stale_by_times(summary, [*regenerated_before, row(4, "replaced", edited)])
    after_it = [row(5, "replaced", written + 1)]  # a turn it does not cover
    assert not summary_stale_by_times(summary, after_it)
    unsummarized = SimpleNamespace(summary_until=None, summary_written=None)
    assert not summary_stale_by_times(unsummarized, after_it)


def test_turns_cut_by_a_fallbacks_window_are_not_summarized_for_good() -> None:
    """Shed to a fallback with a smaller window, a chat's older turns were summarized,
    and left out of its own model's larger window ever after."""
    turns = opened(None, None).messages
    assert left_out_for_good(turns, 2, answering="big", conversation_model="big") == turns[:2]
    assert left_out_for_good(turns, 2, answering="small", conversation_model="big") == []
    assert left_out_for_good(turns, 0, answering="big", conversation_model="big") == []
