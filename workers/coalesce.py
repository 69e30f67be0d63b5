"""Coalesce an engine's token deltas into fewer Kafka events.

The first delta goes out at once (time to first token is the headline number);
later ones wait until the window has passed or enough tokens have gathered.
"""

from __future__ import annotations


class Coalescer:
    def __init__(self, window_s: float, max_tokens: int) -> None:
        self.window_s = window_s
        self.max_tokens = max_tokens
        self._text: list[str] = []
        self._tokens = 0
        self._last_flush: float | None = None

    def add(self, delta: str, tokens: int, now: float) -> tuple[str, int] | None:
        """Buffer a delta; return (text, tokens) when it is time to send them."""
        self._text.append(delta)
        self._tokens += tokens
        due = (
            self._last_flush is None
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
        return chunk
