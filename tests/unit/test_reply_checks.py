"""The reply's length a message gets when it names none, against the model's window."""

from __future__ import annotations

import threading
from typing import Any, cast

import pytest

from producers.gateway.chat.checks import ReplyChecks
from producers.gateway.chat.protocol import ReplyOptions
from producers.gateway.chat.routing import Request, route, routed
from producers.gateway.errors import ApiError
from producers.gateway.openai_api.protocol import ChatCompletionRequest
from schemas.events import ChatMessage
from tandoor.models import ModelConfig
from tandoor.policies.api_keys import Principal
from tandoor.policies.moderation import DefaultModerator, Verdict
from tandoor.settings import Settings


def checks(max_model_len: int) -> ReplyChecks:
    model = ModelConfig(source="/models/small", max_model_len=max_model_len)
    settings = Settings(models={"small": model})
    return ReplyChecks(settings, DefaultModerator(), None)  # type: ignore[arg-type]


@pytest.mark.parametrize("window", [256, 512, 640, 2048])
def test_a_short_message_fits_whatever_window_the_model_is_configured_with(window: int) -> None:
    """512 tokens: the default reply took the whole window, every chat message a 413."""
    reply = checks(window)
    caller = Principal("u", "plus", "k")
    max_tokens = reply.max_tokens(caller, ReplyOptions(), "small")
    context = reply.context("small", [ChatMessage(role="user", content="Hi")], max_tokens, False)
    assert context.messages[-1].content == "Hi"
    assert max_tokens == min(512, window // 2)


def test_a_reply_length_asked_for_is_kept() -> None:
    caller = Principal("u", "plus", "k")
    assert checks(512).max_tokens(caller, ReplyOptions(max_tokens=400), "small") == 400


def test_a_length_above_the_tier_is_refused_under_the_name_it_was_sent_with() -> None:
    """OpenAI's `max_completion_tokens` was refused as `max_tokens`, unsent."""
    caller = Principal("u", "free", "k")
    body: dict[str, Any] = {"model": "small", "messages": []}
    reply = checks(512)
    reply.settings.tiers["free"] = reply.settings.tiers["free"].model_copy(
        update={"max_reply_tokens": 100}
    )
    sent = ChatCompletionRequest.model_construct(**body, max_completion_tokens=101)
    with pytest.raises(ApiError) as refused:
        reply.max_tokens(caller, sent.reply_options(), "small")
    assert refused.value.param == "max_completion_tokens"
    assert refused.value.message.startswith("max_completion_tokens 101 is above")


def test_a_removed_model_gets_the_default_and_its_404_later() -> None:
    caller = Principal("u", "plus", "k")
    assert checks(512).max_tokens(caller, ReplyOptions(), "retired") == 512


class ThreadNoting(DefaultModerator):
    def __init__(self) -> None:
        super().__init__(["forbidden"])
        self.threads: set[int] = set()

    def check_input(self, text: str) -> Verdict:
        self.threads.add(threading.get_ident())
        return super().check_input(text)


async def test_many_messages_long_together_are_moderated_off_the_loop() -> None:
    """An OpenAI request or a batch line of 64 messages just under the limit each was
    checked on the loop: 0.9 s during which no stream of the replica moved."""
    moderator = ThreadNoting()
    reply_checks = ReplyChecks(Settings(), moderator, None)  # type: ignore[arg-type]
    messages = [("call +1 (555) 123-4567 " * 600, f"messages.{i}.content") for i in range(64)]
    texts = await reply_checks.all_moderated(messages)
    assert moderator.threads and threading.get_ident() not in moderator.threads
    assert len(texts) == 64 and "555" not in texts[-1] and "[phone]" in texts[-1]
    with pytest.raises(ApiError) as blocked:
        await reply_checks.all_moderated([("fine", "messages.0.content"), ("forbidden", "x.1")])
    assert blocked.value.param == "x.1"


class Serves:
    def served(self, model: str) -> None:
        pass

    def answering(self, model: str, tier: str, takes: object) -> str:
        return model


def test_a_long_chat_on_a_wide_model_drops_its_oldest_turns_within_the_tiers_minute() -> None:
    """Cut only to the model's window: past the tier's minute of tokens every turn was
    a 413 ("send a shorter context"), which a chat page user cannot, and nothing was
    dropped, so nothing was summarized. Stuck for good."""
    model = ModelConfig(source="/models/wide", max_model_len=32_768)
    settings = Settings(models={"wide": model})
    reply_checks = ReplyChecks(settings, DefaultModerator(), None)  # type: ignore[arg-type]
    turn = "word " * 1000
    asked = [
        ChatMessage(role="user" if i % 2 == 0 else "assistant", content=turn) for i in range(25)
    ]
    request = Request("free", "wide", asked, 512, "max_tokens", client_context=False, summary=None)
    chosen, context = routed(cast(Any, Serves()), reply_checks, request)
    assert chosen == "wide" and context.dropped > 0
    assert context.prompt_tokens + 512 <= settings.tiers["free"].tokens_per_minute
    assert context.messages[-1].content == turn  # the new message kept
    huge = [ChatMessage(role="user", content="word " * 25_000)]
    alone = Request("free", "wide", huge, 512, "max_tokens", False, None)
    with pytest.raises(ApiError, match="allows 20000 a minute"):
        routed(cast(Any, Serves()), reply_checks, alone)
    # Refused under the name the caller set the length with (an SDK's newer field).
    newer = Request("free", "wide", huge, 512, "max_completion_tokens", True, None)
    with pytest.raises(ApiError) as refused:
        routed(cast(Any, Serves()), reply_checks, newer)
    assert refused.value.param == "max_completion_tokens", refused.value.message
    assert "max_tokens" not in refused.value.message.replace("max_completion_tokens", "")


class CountingNoting(ReplyChecks):
    """Notes the threads the context is counted on."""

    threads: set[int]

    def context(self, *args: Any, **kwargs: Any) -> Any:
        self.threads.add(threading.get_ident())
        return super().context(*args, **kwargs)


async def test_a_long_request_is_counted_off_the_loop() -> None:
    """Counting a long message's tokens held the loop (98 ms for 32,000 characters with
    SmolLM2's tokenizer), before any quota: a loop of refused requests, never charged,
    stalled every stream of the replica."""
    model = ModelConfig(source="/models/wide", max_model_len=32_768)
    reply_checks = CountingNoting(Settings(models={"wide": model}), DefaultModerator(), None)  # type: ignore[arg-type]
    reply_checks.threads = set()
    for words, on_the_loop in ((10, True), (5_000, False)):
        asked = [ChatMessage(role="user", content="word " * words)]
        request = Request("plus", "wide", asked, 64, "max_tokens", False, None)
        chosen, context = await route(cast(Any, Serves()), reply_checks, request)
        assert chosen == "wide" and context.messages[-1].content == asked[-1].content
        assert (threading.get_ident() in reply_checks.threads) is on_the_loop, words
        reply_checks.threads.clear()
