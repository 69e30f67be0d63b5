"""The subset of OpenAI's chat-completions protocol Tandoor speaks. Every parameter is
honoured or refused with a 400 that names it, never silently dropped: an unknown one
is refused too (the official client sends only what its caller set)."""

from __future__ import annotations

from typing import Literal

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError, ValidationError

from producers.gateway.chat.protocol import CONTENT_MAX_CHARS, ReplyOptions, SamplingOptions
from schemas.errors import shortened
from schemas.events import MAX_REPLY_TOKENS, ChatMessage

# What an SDK's own response message carries when a client sends it back as history
# (`message.model_dump()`): taken when empty, refused by name when it says something.
RESPONSE_ONLY_KEYS = ("refusal", "annotations", "audio", "function_call", "tool_calls")


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # as the request: no conversions

    role: Literal["system", "developer", "user", "assistant"]
    name: str | None = Field(
        default=None,
        max_length=256,
        description="Taken, and not given to the model: these models' chat templates have "
        "no place for it (vLLM's drop it too).",
    )
    content: str = Field(
        max_length=CONTENT_MAX_CHARS,
        description="A string, or a list of text parts (joined by newlines, as vLLM does).",
    )

    @model_validator(mode="before")
    @classmethod
    def _empty_response_keys(cls, message: object) -> object:
        """Each key of RESPONSE_ONLY_KEYS dropped where it is empty (null, [], ""):
        ignored before, a tool call sent back reached the model as an empty turn."""
        if isinstance(message, dict):
            return {
                key: value
                for key, value in message.items()
                if key not in RESPONSE_ONLY_KEYS or value not in (None, [], "")
            }
        return message

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, content: object) -> object:
        """`[{"type": "text", "text": ...}, ...]`, as the SDK's types, LangChain and
        LiteLLM send it, other keys of a text part ignored as vLLM does (LiteLLM's
        `cache_control` got "part 0 is 'text': only text parts are supported"); any
        other kind of part (an image, audio) is refused by name."""
        if not isinstance(content, list):
            return content
        texts = []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                shown = repr(kind) if isinstance(kind, str) else "not a text part"
                raise ValueError(f"part {i} is {shown[:40]}: only text parts are supported")
            texts.append(part["text"])
        return "\n".join(texts)


OPENAI_TEMPERATURE = 1.0
# OpenAI parameters not served here, taken at a value that asks for nothing: null (how
# wrappers pass an unset option; the SDK sends an explicit None as it is) or their
# "none". Any other value is refused by name, as an unknown parameter is.
ASKING_NOTHING: dict[str, tuple[object, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, True, False),
    "functions": (None, []),
    "function_call": (None, "none"),
    "logit_bias": (None, {}),
    "metadata": (None, {}),
    "service_tier": (None, "auto", "default"),
    "reasoning_effort": (None, "none"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "web_search_options": (None,),
    "verbosity": (None,),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # as the request: no conversions

    include_usage: bool = False
    include_obfuscation: bool = Field(
        default=True, description="Taken; the stream carries no obfuscation padding."
    )


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # as the request: no conversions

    type: Literal["text"] = Field(
        description="Only plain text: structured output (json_object, json_schema) is refused."
    )


class ChatCompletionRequest(SamplingOptions):
    model_config = ConfigDict(extra="forbid", validate_default=True)

    model: str
    messages: list[InputMessage] = Field(min_length=1, max_length=500)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_REPLY_TOKENS)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_REPLY_TOKENS)
    n: int | None = Field(default=None, description="Only 1: one choice per request.")
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    user: str | None = Field(default=None, max_length=256, description="Logged with the request.")
    safety_identifier: str | None = Field(
        default=None, max_length=256, description="OpenAI's successor of `user`: logged so."
    )
    prompt_cache_key: str | None = Field(
        default=None,
        max_length=256,
        description="The calls that share it go to one partition (one worker's prefix "
        "cache); without it, the calls that open with the same messages do.",
    )
    store: bool | None = Field(default=None, description="false: no conversation is kept.")
    ignore_eos: bool = False  # vLLM's extension, for load tests

    @model_validator(mode="before")
    @classmethod
    def _without_options_asking_nothing(cls, body: object) -> object:
        """Dropped at a value that asks for nothing; refused, naming it, at another
        ("Extra inputs are not permitted" read as if the parameter were unknown)."""
        if not isinstance(body, dict):
            return body
        for name, value in body.items():
            if name in ASKING_NOTHING and not _among(value, ASKING_NOTHING[name]):
                takes = " or ".join(_as_json(v, 40) for v in ASKING_NOTHING[name])
                said = f"{_as_json(value, 80)} is not served here: it takes {takes}"
                kind = PydanticCustomError("not_served", said)
                refused = InitErrorDetails(type=kind, loc=(name,), input=value)
                raise ValidationError.from_exception_data(cls.__name__, [refused])
        return {name: value for name, value in body.items() if name not in ASKING_NOTHING}

    @property
    def end_user(self) -> str | None:
        """Whom the caller says the request is for (abuse tracing), by either name."""
        return self.safety_identifier or self.user

    @field_validator("temperature", mode="before")
    @classmethod
    def _openai_default_temperature(cls, temperature: object) -> object:
        """Left out or null: OpenAI's default of 1 (the chat API's 0.7 made an unchanged
        client's completions less varied than on OpenAI or vLLM's server, unsaid)."""
        return OPENAI_TEMPERATURE if temperature is None else temperature

    @field_validator("stream", mode="before")
    @classmethod
    def _null_is_not_streamed(cls, stream: object) -> object:
        """null, as clients send an unset option (OpenAI's server takes it as false)."""
        return False if stream is None else stream

    @field_validator("stream_options")
    @classmethod
    def _only_streamed(cls, options: StreamOptions | None, info: ValidationInfo) -> object:
        """As vLLM's and OpenAI's servers: taken and ignored, it was a parameter dropped
        (a batch line's, a call not streamed)."""
        if options is not None and not info.data.get("stream"):
            raise ValueError("only allowed when `stream` is true")
        return options

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n not in (None, 1):
            raise ValueError("only 1 is supported: one choice per request")
        return n

    @field_validator("logprobs", "top_logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool | int | None) -> None:
        if value:
            raise ValueError("log probabilities are not supported")
        return None

    def reply_options(self) -> ReplyOptions:
        """How to generate the reply, as the chat surface takes it."""
        options = ReplyOptions(
            **self.model_dump(include=set(SamplingOptions.model_fields)),
            max_tokens=self.max_completion_tokens or self.max_tokens,
            ignore_eos=self.ignore_eos,
        )
        if self.max_completion_tokens:
            options._length_param = "max_completion_tokens"
        return options

    def chat_messages(self, texts: list[str]) -> list[ChatMessage]:
        """The messages with `texts` (moderated) as their contents; `developer` is the
        models' `system`."""
        return [
            ChatMessage(role="system" if m.role == "developer" else m.role, content=text)
            for m, text in zip(self.messages, texts, strict=True)
        ]


def _as_json(value: object, limit: int) -> str:
    """For a refusal: never raises (nested past what orjson writes, 255 levels, or an
    integer past 64 bits, it raised a TypeError, which stopped batch admission at the
    line for good)."""
    try:
        return shortened(orjson.dumps(value, default=str).decode(), limit)
    except TypeError:
        return f"a value of type {type(value).__name__} too large or deep to quote"


def _among(value: object, values: tuple[object, ...]) -> bool:
    """By type and value: 0 is not False, nor 1 True (a bool is an int to Python's ==)."""
    return any(type(value) is type(known) and value == known for known in values)
