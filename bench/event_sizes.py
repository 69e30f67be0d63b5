"""Encoded sizes of representative events (schemas.codec), as Kafka stores them: what
the capacity plan's Kafka and disk figures are made of."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from schemas.codec import encode
from schemas.events import (
    ChatMessage,
    FinalEvent,
    PromptRequest,
    TokenEvent,
    Usage,
    UsageRecord,
)
from tandoor.settings import Settings

PROMPT_TOKENS = 1_000  # ASSUMPTION: system prompt + history within the context budget
CHARS_PER_TOKEN = 4.0  # ASSUMPTION: English text with a BPE tokenizer
RECORD_OVERHEAD_BYTES = 70  # record header in a v2 batch + key (request id) + batch share


@dataclass(frozen=True)
class EventSizes:
    """Encoded bytes (schemas.codec) of representative events, plus Kafka overhead."""

    prompt: int
    token: int
    final: int
    usage: int


def measure_sizes(reply_tokens: float, tokens_per_event: int) -> EventSizes:
    rid, uid, cid = (f"r_{uuid.uuid4().hex}", uuid.uuid4().hex, uuid.uuid4().hex)
    reply = "x" * round(reply_tokens * CHARS_PER_TOKEN)
    prompt = PromptRequest(
        request_id=rid,
        model="llama-8b",
        user_id=uid,
        tier="plus",
        band="interactive-paid",
        conversation_id=cid,
        messages=[
            ChatMessage(role="system", content=Settings().system_prompt or ""),
            ChatMessage(role="user", content="x" * round(PROMPT_TOKENS * CHARS_PER_TOKEN)),
        ],
        created_at_ms=1_770_000_000_000,
        deadline_ms=1_770_000_120_000,
        reply_partition=517,
        prompt_tokens_estimate=PROMPT_TOKENS,
        charged_tokens=PROMPT_TOKENS + 512,
    )
    token = TokenEvent(
        request_id=rid,
        attempt=1,
        seq=57,
        delta="x" * round(tokens_per_event * CHARS_PER_TOKEN),
        token_count=tokens_per_event,
        created_at_ms=1_770_000_001_000,
    )
    usage = Usage(
        prompt_tokens=PROMPT_TOKENS,
        completion_tokens=166,
        queue_ms=12.5,
        ttft_ms=180.25,
        decode_ms=3310.5,
    )
    final = FinalEvent(
        request_id=rid,
        attempt=1,
        seq=80,
        finish_reason="stop",
        text=reply,
        usage=usage,
        model="llama-8b",
        user_id=uid,
        tier="plus",
        conversation_id=cid,
        created_at_ms=1_770_000_003_500,
        prompt_created_at_ms=1_770_000_000_000,
    )
    record = UsageRecord(
        request_id=rid,
        attempt=1,
        user_id=uid,
        tier="plus",
        model="llama-8b",
        prompt_tokens=PROMPT_TOKENS,
        completion_tokens=166,
        queue_ms=12.5,
        ttft_ms=180.25,
        duration_ms=3500.0,
        finish_reason="stop",
        finished_at_ms=1_770_000_003_500,
    )
    return EventSizes(
        *(len(encode(event)) + RECORD_OVERHEAD_BYTES for event in (prompt, token, final, record))
    )
