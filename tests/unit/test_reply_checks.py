"""The reply's length a message gets when it names none, against the model's window."""

from __future__ import annotations

import threading

import pytest

from producers.gateway.chat.checks import ReplyChecks
from producers.gateway.chat.protocol import ReplyOptions
from producers.gateway.errors import ApiError
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
