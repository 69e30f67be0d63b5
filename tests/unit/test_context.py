from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from schemas.events import ChatMessage
from tandoor.models import tokenizer_file
from tandoor.policies.context import (
    LOOK_AGAIN_S,
    MESSAGE_OVERHEAD,
    ContextTooLong,
    ModelCounters,
    assemble,
    count_tokens,
)
from tandoor.settings import Settings


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
    assert "2048" in message and "256" in message
    assert info.value.budget == int((2048 - 256) * 0.9)  # the margin is the prompt's alone


def test_empty_history_is_refused() -> None:
    with pytest.raises(ValueError, match="new message"):
        assemble(None, [], context_window=2048, reply_tokens=16)


def test_tiktoken_counts_offline() -> None:
    assert count_tokens("Hello world") == 2
    assert count_tokens("") == 0
    assert count_tokens("<|endoftext|>") > 1  # special tokens are counted as text


def test_a_reply_that_takes_most_of_the_window_leaves_the_rest_to_the_message() -> None:
    """The margin came off the whole window: "hi" with max_tokens 2000 in 2048 was a
    413 ("only 0 fit"), though the engine takes it."""
    context = assemble("sys", [user("hi")], context_window=2048, reply_tokens=2000)
    assert [m.content for m in context.messages] == ["sys", "hi"]


def test_a_models_own_tokenizer_is_used_once_it_is_there(tmp_path: Path) -> None:
    """A bundled model's tokenizer is written by its first worker, maybe after the
    gateway started: until then cl100k, then the model's own count."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tmp_path / "tokenizer.json"
    now = [0.0]
    counters = ModelCounters({"m": path}, clock=lambda: now[0])
    assert counters.counter("m") is count_tokens
    assert counters.counter("other") is count_tokens
    one_per_character = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    one_per_character.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    one_per_character.save(str(path))
    now[0] = LOOK_AGAIN_S - 1
    assert counters.counter("m") is count_tokens  # not looked for again yet
    now[0] = LOOK_AGAIN_S
    assert counters.counter("m")("hello world") == len("hello world")


def test_tokenizers_are_read_as_the_role_starts_not_at_a_first_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading one holds the interpreter (Gemma's: 1.1 s, even from a thread): read at a
    first request, it stalled every stream of the replica."""
    from tokenizers import Tokenizer, models

    path = tmp_path / "tokenizer.json"
    Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")).save(str(path))
    reads: list[str] = []
    real = Tokenizer.from_file

    def counted(file: str) -> Tokenizer:
        reads.append(file)
        return real(file)

    monkeypatch.setattr("tandoor.policies.context.Tokenizer.from_file", counted)
    counters = ModelCounters({"m": path})
    assert reads == [str(path)], "read as the role starts"
    counters.counter("m")("a request")
    assert reads == [str(path)], "read again at a request"


def test_our_own_history_alternates_as_strict_templates_require() -> None:
    """A reply stopped before its first word (or failed) is not in the history: the
    user's turns on either side of it were in a row, and Gemma's or Mistral's template
    refused that chat's every later message ("roles must alternate")."""
    history = [user("tell me a story"), user("a short one"), assistant("Once."), user("more")]
    context = assemble(None, history, context_window=200, reply_tokens=20, count=by_words)
    assert [(m.role, m.content) for m in context.messages] == [
        ("user", "tell me a story"),  # an API caller's own turns stay as it sent them
        ("user", "a short one"),
        ("assistant", "Once."),
        ("user", "more"),
    ]
    ours = assemble(None, history, 200, 20, count=by_words, alternating=True)
    assert [(m.role, m.content) for m in ours.messages] == [
        ("user", "tell me a story\n\na short one"),
        ("assistant", "Once."),
        ("user", "more"),
    ]
    assert ours.dropped == 0


def test_a_cut_never_leaves_a_reply_first_without_its_question() -> None:
    history = [user(words(50)), assistant(words(5)), user(words(5))]
    budget_fits_reply_only = 5 + 5 + 2 * MESSAGE_OVERHEAD
    window = int(budget_fits_reply_only / 0.9) + 20 + 1
    loose = assemble(None, history, window, 20, count=by_words)
    assert [m.role for m in loose.messages] == ["assistant", "user"]
    ours = assemble(None, history, window, 20, count=by_words, alternating=True)
    assert [m.role for m in ours.messages] == ["user"]
    assert (ours.dropped, ours.prompt_tokens) == (2, 5 + MESSAGE_OVERHEAD)


async def test_a_long_message_is_counted_while_the_loop_runs() -> None:
    """The gateway counts a long message in a thread (chat/routing.py), but `encode` holds
    the GIL for the whole count: the loop stopped all the same, 60 ms for 32,000
    characters with SmolLM2's tokenizer, before any quota counted the request."""
    settings = Settings()
    path = tokenizer_file(settings.models["smollm2"], settings.cache_dir)
    assert path.is_file(), f"{path}: `tandoor prepare-model smollm2` makes it"
    count = ModelCounters({"smollm2": path}).counter("smollm2")
    text = "".join(chr(0x4E00 + i * 7919 % 20_000) for i in range(32_000))
    counting, ticks = [False], [0]  # steps of the loop while the message is counted

    def counted() -> int:
        counting[0] = True
        try:
            return count(text)
        finally:
            counting[0] = False

    async def ticking() -> None:
        while True:
            await asyncio.sleep(0)
            ticks[0] += counting[0]

    ticker = asyncio.create_task(ticking())
    try:
        assert await asyncio.to_thread(counted) > 1000
    finally:
        ticker.cancel()
    # Thousands when the tokenizer lets go of the GIL; tens, between its calls, when not.
    assert ticks[0] >= 500, f"the loop ran {ticks[0]} times while the message was counted"
