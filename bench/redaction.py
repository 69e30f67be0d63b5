"""Redaction speed, RE2 (what Tandoor runs) beside the Python `re` patterns it replaced,
on ordinary and adversarial text, in one run:

    python -m bench.redaction [--mb 1]

Whole texts (`redact`, `check_input`) in MB/s; a streamed reply (16 KB in 4-character
tokens, as a worker sends them) in replies/s; one look at the end of a streamed reply
(what the redactor may hold back) in milliseconds. The old patterns backtrack
exponentially or quadratically on adversarial text, so they get shorter inputs: the
sizes are printed beside the figures.
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Callable

from bench.machine import cpu_model
from tandoor.policies import moderation
from tandoor.policies.moderation import DefaultModerator, StreamRedactor, redact

# The patterns before RE2 (tandoor/policies/moderation.py until November 2026).
OLD = [
    ("[email]", re.compile(r"\b[\w.+-]+@[\w-]+(?:\.[\w-]+)+\b")),
    ("[card]", re.compile(r"\b(?:\d[ -]?){12,18}\d\b")),
    ("[phone]", re.compile(r"(?<![\w+])\+?\d[\d ().-]{7,}\d\b")),
]
OLD_LAST_WORD = re.compile(r"\S*$")
OLD_DIGIT_RUN = re.compile(r"(?:[+(]?\d[\d().-]*[ -]?)+$")

ORDINARY = (
    "Sure! Here is a short answer about rivers. The Nile is about 6,650 km long and flows "
    "north through eleven countries. Write to anna@example.org or call +1 415 555 0100. "
)
REPLY = (ORDINARY * 100)[:16_000]


def old_redact(text: str) -> str:
    for label, pattern in OLD:
        text = pattern.sub(label, text)
    return text


class OldStreamRedactor(StreamRedactor):
    def feed(self, chunk: str) -> str:
        text = self._pending + chunk
        starts = [len(text)]
        for pattern in (OLD_LAST_WORD, OLD_DIGIT_RUN):
            if match := pattern.search(text, max(0, len(text) - 64)):
                starts.append(match.start())
        ready, self._pending = text[: min(starts)], text[min(starts) :]
        return old_redact(ready)


def seconds(work: Callable[[], object]) -> float:
    """Seconds per call (repeated for at least 0.2 s)."""
    started, rounds = time.perf_counter(), 0
    while (elapsed := time.perf_counter() - started) < 0.2 or rounds == 0:
        work()
        rounds += 1
    return elapsed / rounds


def stream(redactor: StreamRedactor, text: str) -> None:
    for i in range(0, len(text), 4):
        redactor.feed(text[i : i + 4])
    redactor.flush()


def held_back(redactor: StreamRedactor, text: str) -> None:
    redactor._pending = text
    redactor.feed("x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=float, default=1.0, help="size of the whole texts")
    size = int(parser.parse_args().mb * 1e6)
    print(f"machine: {cpu_model()}")
    ordinary = (ORDINARY * (size // len(ORDINARY) + 1))[:size]
    dots = "a." * (size // 2)
    check = DefaultModerator(["bomb"]).check_input
    mb = len(ordinary) / 1e6
    print(f"{'':38} {'RE2':>12} {'old re':>12}")
    old_mbs = mb / seconds(lambda: old_redact(ordinary))
    for name, new in [
        ("ordinary text, redact (MB/s)", lambda: redact(ordinary)),
        ("ordinary text, check_input (MB/s)", lambda: check(ordinary)),
    ]:
        print(f"{name:38} {mb / seconds(new):12.1f} {old_mbs:12.1f}")
    old_dots = dots[:4000]
    print(
        f"{'a.a.a... redact (MB/s)':38} {len(dots) / 1e6 / seconds(lambda: redact(dots)):12.1f} "
        f"{len(old_dots) / 1e6 / seconds(lambda: old_redact(old_dots)):12.3f}"
        f"  (old re on {len(old_dots):,} bytes)"
    )
    print(
        f"{'16 KB reply streamed (replies/s)':38} "
        f"{1 / seconds(lambda: stream(StreamRedactor(), REPLY)):12.1f} "
        f"{1 / seconds(lambda: stream(OldStreamRedactor(), REPLY)):12.1f}"
    )
    digits, old_digits = "1" * moderation.HOLD_CHARS + "a", "1" * 22 + "a"
    print(
        f"{'digits then a letter, hold (ms)':38} "
        f"{1000 * seconds(lambda: held_back(StreamRedactor(), digits)):12.3f} "
        f"{1000 * seconds(lambda: held_back(OldStreamRedactor(), old_digits)):12.1f}"
        f"  (RE2 on {len(digits):,} digits, old re on {len(old_digits)}; old re doubles per digit)"
    )


if __name__ == "__main__":
    main()
