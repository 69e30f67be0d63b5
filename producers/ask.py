"""`tandoor ask`: one prompt through the pipeline, its reply streamed to the terminal.
A smoke test of the running stack before any HTTP client exists."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable

from consumers.token_reader import TokenCollector
from producers.prompts import PromptSubmitter
from schemas.events import ChatMessage, FinalEvent, PromptRequest, Sampling, TokenEvent, now_ms
from tandoor.clients import kafka_producer
from tandoor.settings import Settings


async def ask(settings: Settings, text: str, model: str, band: str, max_tokens: int) -> FinalEvent:
    request = PromptRequest(
        request_id=f"ask-{uuid.uuid4().hex[:12]}",
        model=model,
        user_id="cli",
        tier="plus",
        band=band,
        conversation_id=f"ask-{uuid.uuid4().hex[:8]}",
        messages=[ChatMessage(role="user", content=text)],
        sampling=Sampling(max_tokens=max_tokens, temperature=0.0),
        created_at_ms=now_ms(),
    )
    async with kafka_producer(settings, "ask") as producer, TokenCollector(settings) as stream:
        await PromptSubmitter(settings, producer).submit(request)
        printed = 0
        events = stream.events[request.request_id]
        while True:
            await stream.wait_for(_grown_past(events, printed), request.request_id, 300)
            for event in events[printed:]:
                printed += 1
                if isinstance(event, TokenEvent):
                    sys.stdout.write(event.delta)
                    sys.stdout.flush()
                else:
                    sys.stdout.write("\n")
                    return event


def _grown_past(events: list[TokenEvent | FinalEvent], count: int) -> Callable[[], bool]:
    return lambda: len(events) > count
