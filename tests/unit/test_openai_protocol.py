"""What the OpenAI chat-completions request model takes and refuses, without servers."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from producers.gateway.chat.protocol import CONTENT_MAX_CHARS
from producers.gateway.openai_api.protocol import ChatCompletionRequest


def request(content: object) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": content}]}
    return ChatCompletionRequest.model_validate(body)


def test_content_as_text_parts_is_the_same_request_as_a_string() -> None:
    """The SDK's types, LangChain and LiteLLM send a list of text parts: it was a 400
    ("Input should be a valid string")."""
    parts = [{"type": "text", "text": "Name three"}, {"type": "text", "text": "rivers."}]
    assert request(parts).messages[0].content == "Name three\nrivers."
    assert request("Name three\nrivers.").messages == request(parts).messages


@pytest.mark.parametrize(
    ("content", "named"),
    [
        ([{"type": "image_url", "image_url": {"url": "https://x/y.png"}}], "'image_url'"),
        ([{"type": "text", "text": 3}], "'text'"),
        (["just a string"], "not a text part"),
        ([{"type": "text", "text": "x" * (CONTENT_MAX_CHARS + 1)}], "at most"),
    ],
)
def test_other_parts_are_refused_by_name(content: object, named: str) -> None:
    with pytest.raises(ValidationError, match=named) as refused:
        request(content)
    assert refused.value.errors()[0]["loc"] == ("messages", 0, "content")
