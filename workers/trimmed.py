"""Whitespace a chat template trims off the end of a reply it continues.

A template that trims each message (Llama 3's `message['content'] | trim`) renders the
published "Hello, " as "Hello,", and the engine, continuing after it, writes " world":
the reply read "Hello,  world" ("Steps:\n\n\n\n1." after "Steps:\n\n"). What was
trimmed is in the published text already: it is taken off the continuation's start,
as far as the engine writes it again. (A partial of whitespace alone loses the turn
header's own whitespace to the trim too: more than is taken off.)"""

from __future__ import annotations


def trimmed_tail(rendered: str, partial: str) -> str:
    """The whitespace ending `partial` that `rendered`, the prompt continuing it, lacks."""
    if rendered.endswith(partial):
        return ""
    return partial[len(partial.rstrip()) :]


class LeadingWhitespace:
    """Takes what was trimmed off the start of a stream of deltas, as far as the stream
    repeats it: "Hello, " trimmed to "Hello," then "\n\nWorld" keeps its paragraph."""

    def __init__(self, trimmed: str) -> None:
        self._left = trimmed

    def __call__(self, delta: str) -> str:
        if not self._left:
            return delta
        taken = 0
        while taken < min(len(delta), len(self._left)) and delta[taken] == self._left[taken]:
            taken += 1
        self._left = self._left[taken:] if taken == len(delta) else ""
        return delta[taken:]
