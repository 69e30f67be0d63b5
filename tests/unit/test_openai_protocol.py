"""What the OpenAI chat-completions request model takes and refuses, without servers."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from producers.admission.lines import BatchInputLine
from producers.gateway.chat.protocol import (
    CONTENT_MAX_CHARS,
    PostMessage,
    ReplyOptions,
    sampling_for,
)
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


def test_a_completion_that_leaves_temperature_out_samples_at_openais_default() -> None:
    """Left out (as every unchanged SDK call does), it was the chat API's 0.7: less
    varied than on OpenAI or vLLM's server, and nowhere said."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for sent in ({}, {"temperature": None}):
        options = ChatCompletionRequest.model_validate({**body, **sent}).reply_options()
        assert sampling_for(options, 16).temperature == 1.0
    greedy = ChatCompletionRequest.model_validate({**body, "temperature": 0}).reply_options()
    assert sampling_for(greedy, 16).temperature == 0.0
    assert sampling_for(ReplyOptions(), 16).temperature == 0.7  # the chat API's own


def test_message_keys_are_taken_or_refused_by_name_never_dropped() -> None:
    """Every key but role and content was dropped unsaid: a tool call sent back reached
    the model as an empty assistant turn. An SDK's own response message sent back as
    history (`model_dump()`, its unused keys null) is still taken."""
    echoed: dict[str, object] = {"role": "assistant", "content": "Hi.", "refusal": None}
    echoed |= {"tool_calls": None}
    echoed |= {"annotations": [], "audio": None, "function_call": None}
    said = {"role": "user", "content": "hi", "name": "ada"}
    body = {"model": "m", "messages": [said, echoed, {"role": "user", "content": "and?"}]}
    taken = ChatCompletionRequest.model_validate(body)
    assert [m.content for m in taken.messages] == ["hi", "Hi.", "and?"]
    for key, value in (("tool_calls", [{"id": "call_1"}]), ("refusal", "no"), ("weight", 1)):
        sent = {"model": "m", "messages": [{**echoed, key: value}]}
        with pytest.raises(ValidationError) as refused:
            ChatCompletionRequest.model_validate(sent)
        assert refused.value.errors()[0]["loc"] == ("messages", 0, key)


@pytest.mark.parametrize("stop", [5, ["a", 5], {"a": 1}])
def test_a_stop_of_the_wrong_kind_is_refused_as_stop(stop: object) -> None:
    """The 400 named `stop.str`, the union's member, a field no client sent."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop": stop}
    with pytest.raises(ValidationError) as refused:
        ChatCompletionRequest.model_validate(body)
    assert [e["loc"] for e in refused.value.errors()] == [("stop",)]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", True),  # was a one-token reply
        ("max_tokens", "16"),
        ("seed", True),
        ("n", True),
        ("stream", "true"),
        ("temperature", "1"),
        ("store", "false"),  # was a conversation kept: "false" is not false
    ],
)
def test_a_value_of_the_wrong_type_is_refused_not_converted(field: str, value: object) -> None:
    """As OpenAI answers them: a 400 naming the field, not a request with another meaning."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], field: value}
    with pytest.raises(ValidationError) as refused:
        ChatCompletionRequest.model_validate(body)
    assert [e["loc"] for e in refused.value.errors()] == [(field,)]
    if field in PostMessage.model_fields:  # the chat API's message, alike
        with pytest.raises(ValidationError):
            PostMessage.model_validate({"content": "hi", field: value})


@pytest.mark.parametrize(
    ("nested", "where"),
    [
        ({"stream": True, "stream_options": {"include_usage": "false"}}, "include_usage"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "include_usage"),
        ({"messages": [{"role": "user", "content": "hi", "name": 7}]}, "name"),
    ],
)
def test_a_nested_value_of_the_wrong_type_is_refused_too(
    nested: dict[str, object], where: str
) -> None:
    """ "false" was taken as false, 1 as true: strict stopped at the top level."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **nested}
    with pytest.raises(ValidationError) as refused:
        ChatCompletionRequest.model_validate(body)
    assert where in str(refused.value.errors()[0]["loc"])


def test_a_whole_number_is_taken_where_a_fraction_may_be() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    taken = ChatCompletionRequest.model_validate({**body, "temperature": 0, "top_p": 1})
    assert (taken.temperature, taken.top_p) == (0.0, 1.0)


def test_a_length_is_refused_under_the_name_it_was_sent_with() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    asked = ChatCompletionRequest.model_validate({**body, "max_completion_tokens": 9})
    assert asked.reply_options().length_param == "max_completion_tokens"
    assert asked.reply_options().max_tokens == 9
    older = ChatCompletionRequest.model_validate({**body, "max_tokens": 9})
    assert older.reply_options().length_param == "max_tokens"


@pytest.mark.parametrize(
    "unset",
    [
        {"logit_bias": None},
        {"metadata": None},
        {"service_tier": None},
        {"reasoning_effort": None},
        {"reasoning_effort": "none"},
        {"tools": None},
        {"tool_choice": None},
        {"parallel_tool_calls": None},
        {"tools": [], "tool_choice": "none"},
        {"parallel_tool_calls": False},
        {"logit_bias": {}},
        {"service_tier": "auto"},
        {"modalities": ["text"]},
        {"safety_identifier": "end-user-7"},
        {"prompt_cache_key": "chat-42"},
    ],
)
def test_options_that_ask_for_nothing_here_are_taken(unset: dict[str, object]) -> None:
    """Wrappers pass an unset option as null (the SDK sends an explicit None as is), or
    its value that asks for nothing: OpenAI's server and vLLM's take them, and here each
    was a 400 ("Extra inputs are not permitted") on every call. `safety_identifier` and
    `prompt_cache_key` are what the SDK now advises in place of `user`."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **unset}
    ChatCompletionRequest.model_validate(body)


@pytest.mark.parametrize(
    "asked",
    [
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
        {"tool_choice": "required"},
        {"logit_bias": {"50256": -100}},
        {"reasoning_effort": "high"},
        {"modalities": ["text", "audio"]},
        {"made_up": None},
    ],
)
def test_options_that_ask_for_what_is_not_served_are_refused_by_name(
    asked: dict[str, object],
) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **asked}
    with pytest.raises(ValidationError, match=next(iter(asked))):
        ChatCompletionRequest.model_validate(body)


def test_an_option_not_served_says_what_it_was_sent_and_what_it_takes() -> None:
    """ "Extra inputs are not permitted" for tool_choice "auto" (which LangChain sends
    with no tools) read as if the parameter itself were unknown."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(ValidationError) as refused:
        ChatCompletionRequest.model_validate({**body, "tool_choice": "auto"})
    assert [(e["loc"], e["msg"]) for e in refused.value.errors()] == [
        (("tool_choice",), '"auto" is not served here: it takes null or "none"')
    ]
    long_tools = [{"type": "function", "function": {"name": "f" * 500}}]
    with pytest.raises(ValidationError) as refused:
        ChatCompletionRequest.model_validate({**body, "tools": long_tools})
    assert len(str(refused.value)) < 400, "the value shortened"
    with pytest.raises(ValidationError) as refused:  # past 64 bits: orjson cannot write it
        ChatCompletionRequest.model_validate({**body, "service_tier": 10**30})
    assert "a value of type int too large or deep to quote" in str(refused.value)


def test_the_safety_identifier_is_the_end_user_logged() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    marked = ChatCompletionRequest.model_validate({**body, "safety_identifier": "end-user-7"})
    assert marked.end_user == "end-user-7"
    both = ChatCompletionRequest.model_validate({**body, "user": "u", "safety_identifier": "s"})
    assert both.end_user == "s"
