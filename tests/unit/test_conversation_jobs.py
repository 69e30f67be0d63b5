"""Conversation jobs: turning model answers into titles, and what a job is shown."""

from __future__ import annotations

import pytest

from producers.gateway.chat.jobs import clean_title, transcript
from producers.gateway.conversations.protocol import AUTO_TITLE_CHARS


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
