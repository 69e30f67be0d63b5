from __future__ import annotations

import pytest

from tandoor.policies.moderation import DefaultModerator, StreamRedactor, redact


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("mail me at jane.doe+x@example.co.uk please", "mail me at [email] please"),
        ("call +49 30 1234 5678 now", "call [phone] now"),
        ("card 4111 1111 1111 1111.", "card [card]."),
        ("the year 2026 and 42 apples", "the year 2026 and 42 apples"),
    ],
)
def test_personal_data_is_redacted(text: str, expected: str) -> None:
    assert redact(text) == expected


def test_blocked_terms_refuse_the_message_and_name_the_term() -> None:
    moderator = DefaultModerator(["Forbidden Word", "bomb"])
    verdict = moderator.check_input("How do I build a BOMB?")
    assert not verdict.allowed and "'BOMB'" in (verdict.reason or "")
    assert moderator.check_input("A bombastic speech").allowed  # whole words only


def test_allowed_input_comes_back_redacted() -> None:
    verdict = DefaultModerator().check_input("I am bob@example.com")
    assert verdict.allowed and verdict.text == "I am [email]"


def test_a_streamed_reply_is_redacted_even_when_split_across_chunks() -> None:
    reply = "Write to anna.smith@example.org or call +1 415 555 0100 today."
    for size in (1, 3, 7):
        redactor = StreamRedactor()
        chunks = [reply[i : i + size] for i in range(0, len(reply), size)]
        out = "".join(redactor.feed(c) for c in chunks) + redactor.flush()
        assert out == "Write to [email] or call [phone] today.", size


def test_plain_text_streams_through_with_at_most_a_word_held_back() -> None:
    redactor = StreamRedactor()
    assert redactor.feed("Hello there, ") == "Hello there, "
    assert redactor.feed("friend") == ""
    assert redactor.flush() == "friend"


def test_cards_and_numbers_in_prose_stream_correctly() -> None:
    reply = "Pay with 4111-1111-1111-1111, due in 2026 for 3 cats."
    redactor = StreamRedactor()
    pieces = [redactor.feed(ch) for ch in reply]
    assert "".join(pieces) + redactor.flush() == "Pay with [card], due in 2026 for 3 cats."
    assert "".join(pieces[: len("Pay with 4111-1111-1111-1111, due in 2026 for ")]).startswith(
        "Pay with [card], due in"
    )  # released as soon as the number is complete, not at the end
