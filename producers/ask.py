"""`tandoor ask`: one prompt through the pipeline, its reply streamed to the terminal.
A smoke test of the running stack before any HTTP client exists."""

from __future__ import annotations

import contextlib
import sys
import uuid
from collections.abc import Callable

from consumers.token_reader import TokenCollector
from producers.prompts import PromptSubmitter
from schemas.events import ChatMessage, FinalEvent, PromptRequest, Sampling, TokenEvent, now_ms
from tandoor.clients import kafka_producer
from tandoor.settings import Settings


def ask_request(text: str, model: str, band: str, max_tokens: int) -> PromptRequest:
    """Kept as no one's conversation (`store: false`): its conversation was opened by no
    gateway, so its stored reply and conversation row had no owner to read or delete
    them, one more at each smoke test. Its usage is kept, under the user `cli`."""
    return PromptRequest(
        request_id=f"ask-{uuid.uuid4().hex[:12]}",
        model=model,
        user_id="cli",
        tier="plus",
        band=band,
        conversation_id=f"ask-{uuid.uuid4().hex[:8]}",
        messages=[ChatMessage(role="user", content=text)],
        sampling=Sampling(max_tokens=max_tokens, temperature=0.0),
        created_at_ms=now_ms(),
        store=False,
    )


async def ask(settings: Settings, text: str, model: str, band: str, max_tokens: int) -> FinalEvent:
    request = ask_request(text, model, band, max_tokens)
    async with contextlib.AsyncExitStack() as stack:
        producer = kafka_producer(settings, "ask")
        stack.push_async_callback(producer.stop)  # a start that fails leaves it open too
        await producer.start()
        collector = TokenCollector(settings, only={request.request_id})
        stream = await stack.enter_async_context(collector)
        await PromptSubmitter(settings, producer).submit(request)
        printed, shown = 0, Shown()
        events = stream.events[request.request_id]
        while True:
            await stream.wait_for(_grown_past(events, printed), request.request_id, 300)
            for event in events[printed:]:
                printed += 1
                if isinstance(event, TokenEvent):
                    sys.stdout.write(shown.text_of(event))
                    sys.stdout.flush()
                else:
                    sys.stdout.write("\n")
                    return event


class Shown:
    """What the terminal shows of a reply's token events: each (attempt, seq) once (a
    worker that takes a reply over sends again what was sent: it printed twice), and a
    restart said (both attempts' text ran together)."""

    def __init__(self) -> None:
        self._seen: set[tuple[int, int]] = set()
        self._attempt: int | None = None

    def text_of(self, event: TokenEvent) -> str:
        if (event.attempt, event.seq) in self._seen:
            return ""
        self._seen.add((event.attempt, event.seq))
        restarted = self._attempt is not None and event.attempt != self._attempt
        self._attempt = event.attempt
        return ("\n[the reply restarted]\n" if restarted else "") + event.delta


def _grown_past(events: list[TokenEvent | FinalEvent], count: int) -> Callable[[], bool]:
    return lambda: len(events) > count
