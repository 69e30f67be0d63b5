"""Test helpers: prompts for the real pipeline."""

from __future__ import annotations

import uuid

from schemas.events import ChatMessage, PromptRequest, Sampling, now_ms


def prompt(
    model: str,
    text: str,
    *,
    band: str = "interactive-paid",
    max_tokens: int = 32,
    deadline_ms: int | None = None,
    conversation_id: str | None = None,
) -> PromptRequest:
    return PromptRequest(
        request_id=f"req-{uuid.uuid4().hex[:12]}",
        model=model,
        user_id="tester",
        tier="plus",
        band=band,
        conversation_id=conversation_id or f"conv-{uuid.uuid4().hex[:8]}",
        messages=[ChatMessage(role="user", content=text)],
        sampling=Sampling(max_tokens=max_tokens, temperature=0.0),
        created_at_ms=now_ms(),
        deadline_ms=deadline_ms,
    )
