"""Event types carried on Kafka. Every event has a schema version `v`.

Compatibility rule: adding an optional field keeps the version (readers ignore
fields they do not know); anything else (a removed, renamed or retyped field)
bumps `SCHEMA_VERSION` of that event and readers reject versions they do not
know.
"""

from __future__ import annotations

import time
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

FinishReason = Literal["stop", "length", "cancelled", "expired", "error"]
# A reply that ran to its end (the model stopped, or reached max_tokens): a successful one.
ANSWERED: frozenset[FinishReason] = frozenset({"stop", "length"})
# How a final's `error` begins when the prompt was too long for the engine (the
# gateway's tiktoken estimate let it through): the caller's fault, unlike every other
# error (the engine failed, token events were not delivered), which a retry may cure.
TOO_LONG_FOR_ENGINE = "prompt has "
# ... and when the model's chat template refused the conversation ("roles must
# alternate"): the caller's too.
TEMPLATE_REFUSED = "the chat template refused the conversation: "
PromptKind = Literal["chat", "title", "summary", "batch"]
# Asked for by the gateway, not by the user: not the user's usage (charged no quota).
SERVICE_JOBS: tuple[PromptKind, ...] = ("title", "summary")

# What any surface (chat API, OpenAI API, batch lines) accepts for one reply.
MAX_REPLY_TOKENS = 4096
MAX_TEMPERATURE = 2.0
MAX_PENALTY = 2.0  # presence and frequency penalties, either sign (OpenAI's range)
MAX_STOP_SEQUENCES = 4
# A prompt's ids key its replies and usage records, which carry them again: a 600 KB
# request id made each answer too large for Kafka, and every worker given the partition
# stopped on it in turn. Ours are far shorter; workers refuse longer ones (`answerable`).
MAX_ID_CHARS = 256
MAX_STOP_CHARS = 256  # each: the prompt's Kafka record has a size limit (1 MiB)
MAX_CONVERSATION_MESSAGES = 2000  # replaced ones included (a turn adds two)


def now_ms() -> int:
    """Wall-clock milliseconds, the unit of every *_ms timestamp in events."""
    return int(time.time() * 1000)


class Event(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore", strict=True)

    SCHEMA_VERSION: ClassVar[int] = 1
    v: int = 1


class ChatMessage(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore", strict=True)

    role: Literal["system", "user", "assistant"]
    content: str


class MessageKey(BaseModel):
    """Where a stored message sits in its conversation (its messages_by_conversation key)."""

    model_config = ConfigDict(frozen=True, extra="ignore", strict=True)

    created_at_ms: int
    message_id: str = Field(min_length=1)


class Sampling(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore", strict=True)

    max_tokens: int = Field(default=512, ge=1)
    temperature: float = Field(default=0.7, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    presence_penalty: float = Field(default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    # Generate exactly max_tokens (benchmarks and load tests; vLLM's ignore_eos).
    ignore_eos: bool = False


class PromptRequest(Event):
    """A prompt for one model, published to `prompts.<model>` in its band's partitions."""

    type: Literal["prompt"] = "prompt"
    request_id: str = Field(min_length=1)
    model: str = Field(min_length=1)
    user_id: str = Field(min_length=1)
    tier: str
    band: str
    conversation_id: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    sampling: Sampling = Field(default_factory=Sampling)
    created_at_ms: int
    deadline_ms: int | None = None
    # Partition of `tokens` the caller reads; the worker keys by request id but
    # produces there so one gateway replica sees the whole reply.
    reply_partition: int | None = Field(default=None, ge=0)
    kind: PromptKind = "chat"
    batch_id: str | None = None
    # A batch line's own name (OpenAI batch input's `custom_id`), given back in its result.
    custom_id: str | None = None
    prompt_tokens_estimate: int = Field(default=0, ge=0)
    # What admission charged to the tokens-per-minute quota (prompt + max_tokens), in
    # the minute of created_at_ms; settled against the real usage once it is known.
    charged_tokens: int = Field(default=0, ge=0)
    # False: the reply is not kept as a conversation message (OpenAI's `store: false`);
    # its usage still is.
    store: bool = True
    # What this reply supersedes (a regenerate's old replies, an edit's old turns). The
    # gateway hides them once the prompt is queued; the final carries them so persistence
    # hides them too, should that gateway have died in between.
    replaces: list[MessageKey] = Field(default_factory=list)


class TokenEvent(Event):
    """Text generated since the previous event of the same request and attempt."""

    type: Literal["token"] = "token"
    request_id: str = Field(min_length=1)
    attempt: int = Field(ge=1)
    seq: int = Field(ge=0)
    delta: str
    token_count: int = Field(ge=0)
    created_at_ms: int


class Usage(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore", strict=True)

    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    cached_tokens: int = Field(default=0, ge=0)
    queue_ms: float = Field(ge=0)
    ttft_ms: float | None = Field(default=None, ge=0)
    decode_ms: float = Field(ge=0)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class FinalEvent(Event):
    """The last event of one attempt: how it ended, its whole text and its usage."""

    type: Literal["final"] = "final"
    request_id: str = Field(min_length=1)
    attempt: int = Field(ge=1)
    seq: int = Field(ge=0)
    finish_reason: FinishReason
    error: str | None = None
    text: str
    usage: Usage
    model: str
    user_id: str
    tier: str
    conversation_id: str
    kind: PromptKind = "chat"
    created_at_ms: int
    # The prompt's creation time: stable across attempts, so stores key on it.
    prompt_created_at_ms: int | None = None
    batch_id: str | None = None
    custom_id: str | None = None  # the prompt's
    store: bool = True  # the prompt's
    replaces: list[MessageKey] = Field(default_factory=list)  # the prompt's

    def failed_with(self, prefix: str) -> bool:
        """An error whose reason begins with `prefix` (TOO_LONG_FOR_ENGINE,
        TEMPLATE_REFUSED: the caller's fault, a 400, not a retried 5xx)."""
        return self.finish_reason == "error" and (self.error or "").startswith(prefix)


class ControlEvent(Event):
    """A command for whichever worker holds (or will take) the request."""

    type: Literal["control"] = "control"
    command: Literal["cancel"]
    request_id: str = Field(min_length=1)
    issued_at_ms: int
    reason: str | None = None


class UsageRecord(Event):
    """One per finished request, on `usage`."""

    type: Literal["usage"] = "usage"
    request_id: str = Field(min_length=1)
    attempt: int = Field(ge=1)
    user_id: str
    tier: str
    model: str
    kind: PromptKind = "chat"
    batch_id: str | None = None
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    # Of prompt_tokens, those the engine found in its prefix cache (not computed again).
    cached_tokens: int = Field(default=0, ge=0)
    queue_ms: float = Field(ge=0)
    ttft_ms: float | None = Field(default=None, ge=0)
    duration_ms: float = Field(ge=0)
    finish_reason: FinishReason
    finished_at_ms: int
    charged_tokens: int = Field(default=0, ge=0)  # from the prompt: see PromptRequest
    charged_at_ms: int | None = None


TokenStreamEvent = TokenEvent | FinalEvent


class Percentiles(BaseModel):
    """Upper bounds of the histogram buckets holding p50, p95 and p99 (None: no data);
    past the last bucket (TTFT over ~180 s, decoding over ~3,000 tokens/s), the largest
    value seen."""

    model_config = ConfigDict(frozen=True, extra="ignore", strict=True)

    p50: float | None
    p95: float | None
    p99: float | None


class RollupSummary(BaseModel):
    """One window of usage for one user or model, on `usage.rollups` (the streams app,
    streams/rollups.py), keyed `<dimension>/<key>/<window>/<start_ms>`; the latest
    message per key is the rollup's state."""

    model_config = ConfigDict(frozen=True, extra="ignore", strict=True)

    SCHEMA_VERSION: ClassVar[int] = 1
    window: Literal["1m", "1h"]
    start_ms: int
    end_ms: int
    # The window has ended (later records may still update it); the last message of a
    # closed window is its final state.
    closed: bool = False
    dimension: Literal["user", "model"]
    key: str
    requests: int = Field(ge=0)
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    cached_tokens: int = Field(default=0, ge=0)
    errors: int = Field(ge=0)
    stops: int = Field(ge=0)
    restarts: int = Field(ge=0)
    ttft_ms: Percentiles
    decode_tokens_per_s: Percentiles
