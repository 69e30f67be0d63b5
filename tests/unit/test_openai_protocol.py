"""What the OpenAI chat-completions request model takes and refuses, without servers."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from producers.admission.lines import BatchInputLine
from producers.gateway.chat.protocol import CONTENT_MAX_CHARS, PostMessage, ReplyOptions
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
    cached = [{"type": "text", "text": "Name three", "cache_control": {"type": "ephemeral"}}]
    assert request(cached).messages[0].content == "Name three"  # LiteLLM's, as vLLM takes it


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


@pytest.mark.parametrize("stop", ["\n", ["\n"]])
def test_a_stop_string_is_taken_alike_on_every_surface(stop: object) -> None:
    """OpenAI's `stop` may be one string: taken on the OpenAI API and on batch lines,
    it was a 400 "Input should be a valid list" on the chat routes."""
    completion = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop": stop}
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions"}
    parsed = [
        PostMessage.model_validate({"content": "hi", "stop": stop}),
        ReplyOptions.model_validate({"stop": stop}),  # edit and regenerate
        ChatCompletionRequest.model_validate(completion),
        BatchInputLine.model_validate({**line, "body": completion}).body,
    ]
    assert [options.stop for options in parsed] == [["\n"]] * len(parsed)
    with pytest.raises(ValidationError, match="stop sequences"):
        PostMessage.model_validate({"content": "hi", "stop": ""})


def test_options_clients_send_unset_or_by_default_are_taken() -> None:
    """`stream: null` (an unset option, as some clients send it) and OpenAI's newer
    `stream_options.include_obfuscation` were 400s."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert ChatCompletionRequest.model_validate({**body, "stream": None}).stream is False
    options = {"include_usage": True, "include_obfuscation": False}
    streamed = ChatCompletionRequest.model_validate(
        {**body, "stream": True, "stream_options": options}
    )
    assert streamed.stream_options is not None and streamed.stream_options.include_usage
    with pytest.raises(ValidationError, match="valid boolean"):
        ChatCompletionRequest.model_validate({**body, "stream": "sometimes"})
