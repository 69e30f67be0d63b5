"""Server-sent events of one reply: `id:`, `data: <json>`, and `data: [DONE]` at the end.

An event id is "<attempt>.<characters sent so far>". The reply's text passes through
the output filter, which may hold back a few characters, so ids count what the client
really has: a reconnect with Last-Event-ID replays the request from its start and
skips exactly that much. A higher attempt (a worker crashed, another re-runs the
request) is announced with a `restart` event: the client drops its partial text
instead of mixing two attempts; duplicates are skipped by sequence number.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import orjson

from consumers.fanout import Delivered
from producers.gateway.errors import ApiError, count
from schemas.events import FinalEvent
from tandoor.policies.moderation import OutputFilter

DONE = "data: [DONE]\n\n"
KEEPALIVE = ": keep-alive\n\n"
NO_ANSWER = "no worker answered in time: the model may be down or overloaded; please retry"


def frame(data: dict[str, Any], event_id: str | None = None) -> str:
    head = f"id: {event_id}\n" if event_id else ""
    return f"{head}data: {orjson.dumps(data).decode()}\n\n"


@dataclass(frozen=True)
class ResumePoint:
    attempt: int
    chars: int

    @classmethod
    def parse(cls, value: str | None) -> ResumePoint | None:
        """An event id this gateway sent (`<attempt>.<characters>`), None for no header;
        anything else is a 400 (non-ASCII digits and huge numbers included)."""
        if value is None:
            return None
        attempt, sep, chars = value.partition(".")
        number, sent = count(attempt), count(chars)
        if not sep or number is None or sent is None:
            raise ApiError(400, "Last-Event-ID: not an id this stream sent", param="Last-Event-ID")
        return cls(number, sent)


class _Attempt:
    """Text of the attempt being shown, and how much of it the client already has."""

    def __init__(self, number: int, make_filter: Callable[[], OutputFilter], skip: int) -> None:
        self.number = number
        self.filter = make_filter()
        self.sent = 0
        self.skip = skip
        self.next_seq = 0

    def emit(self, text: str) -> str | None:
        """A token frame for `text` minus what the client has; None if nothing is new."""
        start, self.sent = self.sent, self.sent + len(text)
        new = text[max(0, self.skip - start) :]
        if not new:
            return None
        data = {"type": "token", "delta": new, "attempt": self.number}
        return frame(data, f"{self.number}.{self.sent}")


async def reply_frames(
    items: AsyncIterator[Delivered | None],
    make_filter: Callable[[], OutputFilter],
    resume: ResumePoint | None = None,
) -> AsyncIterator[str]:
    """Frames for a reply's events; None items become keep-alives."""
    current: _Attempt | None = None
    async for item in items:
        if item is None:
            yield KEEPALIVE
            continue
        event = item.event
        if current is not None and event.attempt < current.number:
            continue  # a late event of an abandoned attempt
        if current is None or event.attempt > current.number:
            known = resume is not None and resume.attempt == event.attempt
            if current is not None or (resume is not None and not known):
                yield frame({"type": "restart", "attempt": event.attempt}, f"{event.attempt}.0")
            current = _Attempt(event.attempt, make_filter, resume.chars if known and resume else 0)
        if isinstance(event, FinalEvent):
            tail = current.emit(current.filter.flush())
            if tail:
                yield tail
            yield frame(_final(event), f"{current.number}.{current.sent}")
            yield DONE
            return
        if event.seq < current.next_seq:
            continue  # already handled
        current.next_seq = event.seq + 1
        chunk = current.emit(current.filter.feed(event.delta))
        if chunk:
            yield chunk
    yield frame({"type": "error", "error": NO_ANSWER})  # the events ended without a final
    yield DONE


def _final(event: FinalEvent) -> dict[str, Any]:
    return {
        "type": "final",
        "request_id": event.request_id,
        "attempt": event.attempt,
        "finish_reason": event.finish_reason,
        "error": event.error,
        "model": event.model,
        "usage": event.usage.model_dump(),
    }
