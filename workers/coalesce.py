"""Coalesce an engine's token deltas into fewer Kafka events.

Deltas go out at once until the reply's first word has ended: a reader sees nothing
before that (the gateway holds an unfinished word back, to redact it if it turns out
to be an e-mail address or a number), and time to the first word is the headline
number. Later ones wait until the window has passed or enough tokens have gathered:
every event is a Redis record, a Kafka produce, two fetches and an SSE write, on the
cores the engine computes on.
"""

from __future__ import annotations

import re

_WORD_ENDED = re.compile(r"\S\s")
OPENING_EVENTS = 8  # a reply without a space in its start is coalesced after these


class Coalescer:
    def __init__(self, window_s: float, max_tokens: int) -> None:
        self.window_s = window_s
        self.max_tokens = max_tokens
        self._text: list[str] = []
        self._tokens = 0
        self._last_flush = 0.0
        self._opening_left = OPENING_EVENTS  # events sent at once; 0 once the word ended
        self._last_char = ""

    def add(self, delta: str, tokens: int, now: float) -> tuple[str, int] | None:
        """Buffer a delta; return (text, tokens) when it is time to send them."""
        self._text.append(delta)
        self._tokens += tokens
        due = (
            self._opening_left > 0
            or now - self._last_flush >= self.window_s
            or self._tokens >= self.max_tokens
        )
        return self.flush(now) if due else None

    def flush(self, now: float) -> tuple[str, int] | None:
        """Whatever is buffered, or None if there is nothing."""
        if not self._text:
            return None
        chunk = ("".join(self._text), self._tokens)
        self._text.clear()
        self._tokens = 0
        self._last_flush = now
        self._note_opening(chunk[0])
        return chunk

    def _note_opening(self, text: str) -> None:
        if not self._opening_left or not text:
            return
        ended = _WORD_ENDED.search(self._last_char + text) is not None
        self._last_char = text[-1]
        self._opening_left = 0 if ended else self._opening_left - 1
