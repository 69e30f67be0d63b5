"""Moderation of what users send and what the model says; pluggable.

The default: a configurable blocklist refuses a message outright, and personal data
(e-mail addresses, phone numbers, payment card numbers) is redacted, in the input
before it reaches the model, in the reply as it streams, and in the reply as stored.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

PATTERNS: list[tuple[str, re.Pattern[str]]] = [
    ("[email]", re.compile(r"\b[\w.+-]+@[\w-]+(?:\.[\w-]+)+\b")),
    ("[card]", re.compile(r"\b(?:\d[ -]?){12,18}\d\b")),
    ("[phone]", re.compile(r"(?<![\w+])\+?\d[\d ().-]{7,}\d\b")),
]
# What a streamed reply may still turn into something to redact: its last, unfinished
# word (an e-mail has no spaces) and a trailing run of digit groups (phone, card).
_LAST_WORD = re.compile(r"\S*$")
_DIGIT_RUN = re.compile(r"(?:[+(]?\d[\d().-]*[ -]?)+$")
_LOOKBACK = 64


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    text: str  # the text to use: redacted where needed
    reason: str | None = None


class Moderator(Protocol):
    def check_input(self, text: str) -> Verdict: ...

    def output_filter(self) -> OutputFilter: ...

    def check_output(self, text: str) -> str:
        """A whole reply as it is stored: what output_filter streams, all at once."""


class OutputFilter(Protocol):
    def feed(self, chunk: str) -> str:
        """Text safe to send now; may hold back the end of `chunk` until more arrives."""

    def flush(self) -> str: ...


class DefaultModerator:
    def __init__(self, blocklist: Iterable[str] = ()) -> None:
        terms = sorted({t.strip().lower() for t in blocklist if t.strip()})
        self._blocked = (
            re.compile(r"\b(?:" + "|".join(map(re.escape, terms)) + r")\b", re.IGNORECASE)
            if terms
            else None
        )

    def check_input(self, text: str) -> Verdict:
        if self._blocked is not None and (hit := self._blocked.search(text)):
            return Verdict(False, text, f"the message contains a blocked term ({hit[0]!r})")
        return Verdict(True, redact(text))

    def output_filter(self) -> OutputFilter:
        return StreamRedactor()

    def check_output(self, text: str) -> str:
        return redact(text)


class StreamRedactor:
    """Redacts a streamed reply, holding back only what could still grow into a match."""

    def __init__(self) -> None:
        self._pending = ""

    def feed(self, chunk: str) -> str:
        text = self._pending + chunk
        hold = _hold_from(text)
        ready, self._pending = text[:hold], text[hold:]
        return redact(ready)

    def flush(self) -> str:
        rest, self._pending = self._pending, ""
        return redact(rest)


def _hold_from(text: str) -> int:
    starts = [len(text)]
    for pattern in (_LAST_WORD, _DIGIT_RUN):
        match = pattern.search(text, max(0, len(text) - _LOOKBACK))
        if match:
            starts.append(match.start())
    return min(starts)


def redact(text: str) -> str:
    for label, pattern in PATTERNS:
        text = pattern.sub(label, text)
    return text
