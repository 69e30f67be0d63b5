from __future__ import annotations

import pytest

from schemas.events import ChatMessage
from tandoor.policies.context import MESSAGE_OVERHEAD, ContextTooLong, assemble, count_tokens


def words(n: int) -> str:
    return " ".join(["word"] * n)


def user(text: str) -> ChatMessage:
    return ChatMessage(role="user", content=text)


def assistant(text: str) -> ChatMessage:
    return ChatMessage(role="assistant", content=text)


def by_words(text: str) -> int:  # an exact, easy counter for the arithmetic below
    return len(text.split())


def test_everything_fits_in_order_after_the_system_prompt() -> None:
    history = [user("hi"), assistant("hello"), user("how are you?")]
    context = assemble("Be brief.", history, context_window=2048, reply_tokens=256)
    assert [m.content for m in context.messages] == ["Be brief.", "hi", "hello", "how are you?"]
    assert context.dropped == 0
    expected = sum(count_tokens(m.content) + MESSAGE_OVERHEAD for m in context.messages)
    assert context.prompt_tokens == expected


def test_oldest_turns_are_dropped_first_when_the_budget_is_full() -> None:
    history = [user(words(40)), assistant(words(40)), user(words(40)), user(words(10))]
    # budget = 200 * 0.9 - 20 = 160; system 5 + 6, newest 10 + 6, each old turn 46
    context = assemble(words(5), history, context_window=200, reply_tokens=20, count=by_words)
    assert context.messages[0].role == "system"
    assert [m.content for m in context.messages[1:]] == [words(40), words(40), words(10)]
    assert context.dropped == 1
    assert context.prompt_tokens == 11 + 16 + 46 + 46


def test_a_gap_stops_the_history_rather_than_skipping_a_turn() -> None:
    history = [user(words(1)), assistant(words(500)), user(words(1))]
    context = assemble(None, history, context_window=200, reply_tokens=20, count=by_words)
    assert [m.content for m in context.messages] == [words(1)]
    assert context.dropped == 2


def test_a_message_that_cannot_fit_names_the_limits() -> None:
    with pytest.raises(ContextTooLong) as info:
        assemble("sys", [user(words(3000))], context_window=2048, reply_tokens=256)
    message = str(info.value)
    assert "2048" in message and "256" in message and info.value.budget == 1587


def test_empty_history_is_refused() -> None:
    with pytest.raises(ValueError, match="new message"):
        assemble(None, [], context_window=2048, reply_tokens=16)


def test_tiktoken_counts_offline() -> None:
    assert count_tokens("Hello world") == 2
    assert count_tokens("") == 0
    assert count_tokens("<|endoftext|>") > 1  # special tokens are counted as text
