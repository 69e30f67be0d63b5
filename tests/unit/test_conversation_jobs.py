"""Conversation jobs: turning model answers into titles, and what a job is shown."""

from __future__ import annotations

import datetime as dt
from types import SimpleNamespace
from typing import Any, cast

import pytest

from producers.gateway.chat.jobs import (
    SHORTEST_EXCERPT,
    ConversationJobs,
    clean_title,
    transcript,
)
from producers.gateway.conversations.protocol import (
    AUTO_TITLE_CHARS,
    ConversationWithMessages,
    Message,
)
from producers.gateway.conversations.service import SUMMARY_WRITTEN_WITHIN_S

AT = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


@pytest.mark.parametrize(
    ("answer", "title"),
    [
        ('"Volcano Formation Basics"', "Volcano Formation Basics"),
        ("Title: How Volcanoes Form.\nThey form when...", "How Volcanoes Form"),
        ("\n\n**Magma and Plates**", "Magma and Plates"),
        ("   ", None),
    ],
)
def test_the_first_line_without_decoration(answer: str, title: str | None) -> None:
    assert clean_title(answer) == title


def test_a_long_answer_is_cut_to_fit() -> None:
    title = clean_title("word " * 40)
    assert title is not None and len(title) <= AUTO_TITLE_CHARS


def test_a_transcript_starts_from_the_previous_summary() -> None:
    text = transcript([("user", "Hi"), ("assistant", "Hello")], previous_summary="We met.")
    assert text == "Earlier: We met.\nUser: Hi\nAssistant: Hello"


def test_a_transcript_too_long_for_the_window_is_shortened_then_its_oldest_turns_left_out() -> None:
    turns = [("user", f"q{i} " + "x" * 2000) for i in range(30)]
    short = transcript(turns, "We met.", fits=lambda text: len(text) <= 20_000)
    assert len(short) <= 20_000 and short.startswith("Earlier: We met.\nUser: q0 ")
    assert all(len(line) <= len("Assistant: ") + 1500 for line in short.splitlines())
    fewer = transcript(turns, "We met.", fits=lambda text: len(text) <= 1_000)
    assert len(fewer) <= 1_000 and fewer.startswith("Earlier: We met.\n")
    assert fewer.splitlines()[-1].startswith("User: q29 x")  # the newest turn stays
    kept = [line.split()[1] for line in fewer.splitlines()[1:]]
    assert kept == [f"q{i}" for i in range(30 - len(kept), 30)], kept  # no gap
    # Each turn kept as long as the shortest excerpt: halving went past it, to 46 chars.
    assert {len(line) for line in fewer.splitlines()[1:]} == {len("User: ") + SHORTEST_EXCERPT}


class Conversations:
    """The conversation as the summary job reads it again, and the summaries it keeps."""

    def __init__(self) -> None:
        self.kept: list[str] = []

    async def get(self, user_id: str, conversation_id: str) -> ConversationWithMessages:
        return ConversationWithMessages(
            id=conversation_id, model="m", title=None, created_at=AT, updated_at=AT, messages=[]
        )

    async def set_summary(self, conversation_id: str, text: str, *_: object) -> None:
        self.kept.append(text)


@pytest.mark.parametrize(("took_s", "kept"), [(1.0, True), (SUMMARY_WRITTEN_WITHIN_S, False)])
async def test_a_summary_that_took_longer_than_its_window_is_not_kept(
    monkeypatch: pytest.MonkeyPatch, took_s: float, kept: bool
) -> None:
    """A summary's staleness is told by write times: a turn replaced within
    SUMMARY_WRITTEN_WITHIN_S before it was written may be in it. One written later than
    that after its turns were read could hold an edit's text and pass for fresh."""
    conversations = Conversations()
    checks = SimpleNamespace(moderator=None, fits=lambda *_: True)
    jobs = ConversationJobs(
        cast(Any, None),
        cast(Any, None),
        cast(Any, conversations),
        cast(Any, None),
        cast(Any, checks),
    )
    clock = iter([100.0, 100.0 + took_s])
    jobs._clock = lambda: next(clock)

    async def answered(*_: object) -> str:
        return "They said hello."

    monkeypatch.setattr(jobs, "_ask", answered)
    turn = Message(id="m1", role="user", content="Hello", status="sent", created_at=AT)
    await jobs._summary("u", cast(Any, SimpleNamespace(id="c", model="m")), None, [turn], False)
    assert conversations.kept == (["They said hello."] if kept else [])
