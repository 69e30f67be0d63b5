"""The subset of OpenAI's chat-completions protocol Tandoor speaks."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from producers.gateway.chat.protocol import CONTENT_MAX_CHARS
from schemas.events import MAX_REPLY_TOKENS, MAX_TEMPERATURE


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str = Field(max_length=CONTENT_MAX_CHARS)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    # Clients send many optional fields; the ones Tandoor does not use are ignored.
    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[InputMessage] = Field(min_length=1, max_length=500)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_REPLY_TOKENS)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_REPLY_TOKENS)
    temperature: float | None = Field(default=None, ge=0.0, le=MAX_TEMPERATURE)
    ignore_eos: bool = False  # vLLM's extension, for load tests
