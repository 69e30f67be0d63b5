"""Server-sent events of one reply: `id:`, `data: <json>`, and `data: [DONE]` at the end.

An event id is "<reply>.<attempt>.<characters sent so far>", <reply> eight hex digits
naming the reply (`reply_tag`): an id of another reply (one that ended while the client
was away, another conversation's) is refused rather than taken as a place in this one,
which spliced the two texts. The reply's text passes through
the output filter, which may hold back a few characters, so ids count what the client
really has: a reconnect with Last-Event-ID replays the request from its start and
skips exactly that much. A higher attempt (a worker crashed, another re-runs the
request and could not continue the reply) is announced with a `restart` event: the
client drops its partial text instead of mixing two attempts; duplicates are skipped
by sequence number. A missing event (a gap in `seq`) holds the text back until the
final, which carries the whole reply: the client gets the rest from it, and never a
text that differs from the stored one.
"""

from __future__ import annotations

import hashlib
import re
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


TAG = re.compile(r"[0-9a-f]{8}")


def reply_tag(request_id: str) -> str:
    return hashlib.blake2s(request_id.encode(), digest_size=4).hexdigest()


@dataclass(frozen=True)
class ResumePoint:
    reply: str | None  # None: an id of the gateways before replies were named in it
    attempt: int
    chars: int

    @classmethod
    def parse(cls, value: str | None) -> ResumePoint | None:
        """An event id this gateway sent (`<reply>.<attempt>.<characters>`), None for no
        header; anything else is a 400 (non-ASCII digits and huge numbers included)."""
        if value is None:
            return None
        parts = value.split(".")
        reply = parts.pop(0) if len(parts) == 3 else None
        number, sent = (count(parts[0]), count(parts[1])) if len(parts) == 2 else (None, None)
        if (reply is not None and not TAG.fullmatch(reply)) or number is None or sent is None:
            raise ApiError(400, "Last-Event-ID: not an id this stream sent", param="Last-Event-ID")
        return cls(reply, number, sent)


class _Attempt:
    """Text of the attempt being shown, and how much of it the client already has."""

    def __init__(
        self, tag: str, number: int, make_filter: Callable[[], OutputFilter], skip: int
    ) -> None:
        self.tag = tag
        self.number = number
        self.make_filter = make_filter
        self.skip = skip
        self.start_over()

    def start_over(self) -> None:
        self.filter = self.make_filter()
        self.sent = 0
        self.next_seq = 0
        self.raw = ""  # the reply's text as received, before the filter
        self.gap = False  # an event is missing: the rest comes from the final

    def feed(self, seq: int, delta: str) -> str | None:
        """The frame for a token event, or None (a duplicate, or held back)."""
        if seq < self.next_seq or self.gap:
            return None
        if seq > self.next_seq:
            self.gap = True
            return None
        self.next_seq, self.raw = seq + 1, self.raw + delta
        return self.emit(self.filter.feed(delta))

    def emit(self, text: str) -> str | None:
        """A token frame for `text` minus what the client has; None if nothing is new."""
        start, self.sent = self.sent, self.sent + len(text)
        new = text[max(0, self.skip - start) :]
        if not new:
            return None
        data = {"type": "token", "delta": new, "attempt": self.number}
        return frame(data, self.event_id)

    @property
    def event_id(self) -> str:
        return f"{self.tag}.{self.number}.{self.sent}"


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
        final = isinstance(event, FinalEvent)
        # Skipped: an attempt abandoned before the one the client resumes. Not a final:
        # older than the id means the id was never sent, and the client needs the end.
        if resume is not None and event.attempt < resume.attempt and not final:
            yield ""
            continue
        if current is not None and event.attempt < current.number:
            yield ""
            continue  # a late event of an abandoned attempt
        if current is None or event.attempt > current.number:
            known = resume is not None and resume.attempt == event.attempt
            tag = reply_tag(event.request_id)
            if current is not None or (resume is not None and not known):
                yield frame(
                    {"type": "restart", "attempt": event.attempt}, f"{tag}.{event.attempt}.0"
                )
            skip = resume.chars if known and resume else 0
            current = _Attempt(tag, event.attempt, make_filter, skip)
        if isinstance(event, FinalEvent):
            for tail in _ending(current, event.text):
                yield tail
            yield frame(_final(event), current.event_id)
            yield DONE
            return
        # Empty where the event makes no frame (held by the redaction, a duplicate): the
        # stream writes what it holds, not waiting for the next event (streaming.py).
        yield current.feed(event.seq, event.delta) or ""
    yield frame({"type": "error", "error": NO_ANSWER})  # the events ended without a final
    yield DONE


def _ending(current: _Attempt, text: str) -> list[str]:
    """The frames that make what the client shows equal the final's whole text: what
    the filter held back, or the rest after a missing event, or, where the text shown
    is not the start of the final one, a restart and the whole text."""
    frames: list[str] = []
    if not text.startswith(current.raw):
        frames.append(frame({"type": "restart", "attempt": current.number}))
        current.skip = 0
        current.start_over()
    rest = current.filter.feed(text[len(current.raw) :]) + current.filter.flush()
    if chunk := current.emit(rest):
        frames.append(chunk)
    return frames


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
