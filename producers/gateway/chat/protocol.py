"""Request bodies of the chat routes."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from schemas.events import (
    MAX_PENALTY,
    MAX_REPLY_TOKENS,
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    MAX_TEMPERATURE,
    Sampling,
)

CONTENT_MAX_CHARS = 32_000


class SamplingOptions(BaseModel):
    """How the model picks its tokens, the same on every surface (unset: its default)."""

    # Strict on every surface, as OpenAI's server: `"max_tokens": true` was a one-token
    # reply, `"store": "false"` a conversation kept. A whole number is taken for a fraction.
    model_config = ConfigDict(extra="forbid", strict=True)

    temperature: float | None = Field(default=None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)  # a long, as vLLM's
    stop: str | list[str] | None = None  # OpenAI's: one string, or a list
    presence_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, stop: object) -> object:
        """Checked here, so the 400 names `stop`, not the union's member ("stop.str")."""
        if stop is None or isinstance(stop, str):
            return stop
        if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
            return stop
        raise ValueError("a string, or a list of strings")

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, stop: str | list[str] | None) -> list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop
        if stops is not None and (
            len(stops) > MAX_STOP_SEQUENCES or not all(0 < len(s) <= MAX_STOP_CHARS for s in stops)
        ):
            raise ValueError(
                f"up to {MAX_STOP_SEQUENCES} non-empty stop sequences "
                f"of up to {MAX_STOP_CHARS} characters"
            )
        return stops


class ReplyOptions(SamplingOptions):
    """How to generate a reply (regenerate takes only these)."""

    max_tokens: int | None = Field(default=None, ge=1, le=MAX_REPLY_TOKENS)
    ignore_eos: bool = Field(default=False, description="Generate exactly max_tokens.")
    # The field the caller set the length with, as a refusal names it (OpenAI's
    # max_completion_tokens was refused as "max_tokens", a field the client never sent).
    _length_param: str = PrivateAttr(default="max_tokens")

    @property
    def length_param(self) -> str:
        return self._length_param


def sampling_for(options: ReplyOptions, max_tokens: int) -> Sampling:
    """The options a caller set, over Sampling's defaults for the rest."""
    chosen = options.model_dump(
        include={"temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty"},
        exclude_none=True,  # 0 is a choice (greedy), None is not
    )
    return Sampling(max_tokens=max_tokens, ignore_eos=options.ignore_eos, **chosen)


class Regenerate(ReplyOptions):
    reply_to: str | None = Field(
        default=None,
        max_length=64,
        description="The id of the user message the reply shown answers: a 409 where the "
        "conversation has a newer one (sent from another tab) rather than answer that.",
    )


class PostMessage(ReplyOptions):
    content: str = Field(min_length=1, max_length=CONTENT_MAX_CHARS)
