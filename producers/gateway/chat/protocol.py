"""Request bodies of the chat routes."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from schemas.events import MAX_REPLY_TOKENS, MAX_TEMPERATURE

CONTENT_MAX_CHARS = 32_000


class ReplyOptions(BaseModel):
    """How to generate a reply (regenerate takes only these)."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int | None = Field(default=None, ge=1, le=MAX_REPLY_TOKENS)
    temperature: float | None = Field(default=None, ge=0.0, le=MAX_TEMPERATURE)
    ignore_eos: bool = Field(default=False, description="Generate exactly max_tokens.")


class PostMessage(ReplyOptions):
    content: str = Field(min_length=1, max_length=CONTENT_MAX_CHARS)
