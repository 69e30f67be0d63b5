"""Load shapes and latency statistics shared by the benchmarks."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

QUESTIONS = [
    "Explain how a bicycle stays upright.",
    "Describe the water cycle.",
    "Write a short poem about autumn.",
    "What makes bread rise?",
    "Give tips for learning a new language.",
    "How do airplanes fly?",
    "Describe a busy market in the morning.",
    "Why is the sky blue?",
]


def question(i: int) -> str:
    return f"{QUESTIONS[i % len(QUESTIONS)]} (request {i})"


@dataclass
class RunStats:
    """One load level against one target."""

    concurrency: int
    ttft_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    errors: int = 0
    wall_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0

    def ttft_ms(self, pct: float) -> float:
        if not self.ttft_s:
            return float("nan")
        if len(self.ttft_s) == 1:
            return self.ttft_s[0] * 1000
        cuts = statistics.quantiles(self.ttft_s, n=100, method="inclusive")
        return cuts[int(pct) - 1] * 1000


def table(rows: list[tuple[str, RunStats]]) -> str:
    head = f"{'target':<28}{'conc':>5}{'reqs':>6}{'err':>5}{'tok/s':>9}{'TTFT p50':>10}{'p95':>9}"
    lines = [head, "-" * len(head)]
    for name, s in rows:
        lines.append(
            f"{name:<28}{s.concurrency:>5}{len(s.ttft_s):>6}{s.errors:>5}"
            f"{s.tokens_per_s:>9.1f}{s.ttft_ms(50):>9.1f}ms{s.ttft_ms(95):>7.1f}ms"
        )
    return "\n".join(lines)
