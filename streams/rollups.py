"""Usage rollups: what one window of one user's (or one model's) traffic adds up to.

A rollup is plain data that merges: counts, token sums, and latency histograms on
fixed log-spaced buckets, so percentiles come from bounded state however many
requests a window holds: its size does not grow with them. Which records were
already counted is the tables' concern (tables.py), not the rollup's.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any

from schemas.events import FinalEvent, UsageRecord

WINDOWS_S = {"1m": 60, "1h": 3600}
# Bucket upper bounds: milliseconds for time to first token, tokens/s for decoding.
TTFT_BOUNDS_MS = [5 * 1.25**i for i in range(48)]  # 5 ms .. ~200 s
SPEED_BOUNDS_TPS = [0.5 * 1.25**i for i in range(40)]  # 0.5 .. ~3000 tokens/s
FAILED = {"error", "expired"}
# A rollup's plain fields: its identity (window, start_ms, dimension, key), then counts.
STATE_FIELDS = (
    "window",
    "start_ms",
    "dimension",
    "key",
    "requests",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "errors",
    "stops",
    "restarts",
    "partition",
    "offset",
)


def window_start_ms(at_ms: int, size_s: int) -> int:
    return at_ms - at_ms % (size_s * 1000)


@dataclass
class Histogram:
    bounds: list[float]
    counts: list[int] = field(default_factory=list)
    # The last bucket has no upper bound (a batch line's TTFT counts its hours queued):
    # a quantile there is the largest value seen, not the last bound.
    highest: float = 0.0

    def add(self, value: float) -> None:
        if not math.isfinite(value):  # a speed over a subnormal time: JSON has no inf
            return
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.highest = max(self.highest, value)

    def percentile(self, q: float) -> float | None:
        """The upper bound of the bucket holding the q-th quantile (within 25%)."""
        total = sum(self.counts)
        if not total:
            return None
        index = self._bucket_of(q * total)
        if index < len(self.bounds):
            return self.bounds[index]
        return max(self.highest, self.bounds[-1])  # a rollup stored before `highest`

    def _bucket_of(self, rank: float) -> int:
        seen = 0
        for index, count in enumerate(self.counts):
            seen += count
            if seen >= rank and count:
                return index
        return len(self.counts) - 1


@dataclass
class Rollup:
    window: str
    start_ms: int
    dimension: str  # "user" or "model"
    key: str
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, found in the engines' prefix caches
    errors: int = 0
    stops: int = 0
    restarts: int = 0  # requests re-run after their worker died (from `tokens`)
    partition: int = -1  # of the table's changelog: who may expire it after a restart
    offset: int = -1  # the last record counted, in that partition of the source topic
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BOUNDS_MS))
    speed: Histogram = field(default_factory=lambda: Histogram(SPEED_BOUNDS_TPS))

    @property
    def end_ms(self) -> int:
        return self.start_ms + WINDOWS_S[self.window] * 1000

    def add(self, record: UsageRecord) -> None:
        self.requests += 1
        self.prompt_tokens += record.prompt_tokens
        self.completion_tokens += record.completion_tokens
        self.cached_tokens += record.cached_tokens
        self.errors += record.finish_reason in FAILED
        self.stops += record.finish_reason == "cancelled"
        if record.ttft_ms is not None:
            self.ttft.add(record.ttft_ms)
            decoding_s = (record.duration_ms - record.ttft_ms) / 1000
            if record.completion_tokens > 1 and decoding_s > 0:
                self.speed.add((record.completion_tokens - 1) / decoding_s)

    def add_restart(self, final: FinalEvent) -> None:
        """Count a re-run's final event (attempt > 1)."""
        self.restarts += final.attempt > 1

    def summary(self, closed: bool = False) -> dict[str, Any]:
        """What analytics read: counts, sums and percentiles, no request ids; `closed`
        once the window has ended (later records still update it)."""
        return {
            "window": self.window,
            "start_ms": self.start_ms,
            "end_ms": self.end_ms,
            "closed": closed,
            "dimension": self.dimension,
            "key": self.key,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "errors": self.errors,
            "stops": self.stops,
            "restarts": self.restarts,
            "ttft_ms": {f"p{int(q * 100)}": self.ttft.percentile(q) for q in (0.5, 0.95, 0.99)},
            "decode_tokens_per_s": {
                f"p{int(q * 100)}": self.speed.percentile(q) for q in (0.5, 0.95, 0.99)
            },
        }

    def dump(self) -> dict[str, Any]:
        """The whole state, for the table's changelog."""
        return {
            **{name: getattr(self, name) for name in STATE_FIELDS},
            "ttft": self.ttft.counts,
            "speed": self.speed.counts,
            "ttft_highest": self.ttft.highest,
            "speed_highest": self.speed.highest,
        }

    @classmethod
    def load(cls, data: dict[str, Any]) -> Rollup:
        rollup = cls(data["window"], data["start_ms"], data["dimension"], data["key"])
        for name in STATE_FIELDS[4:]:
            setattr(rollup, name, data.get(name, getattr(rollup, name)))
        rollup.ttft.counts = list(data["ttft"])
        rollup.speed.counts = list(data["speed"])
        # null: an infinity stored before infinities were left out
        rollup.ttft.highest = data.get("ttft_highest") or 0.0
        rollup.speed.highest = data.get("speed_highest") or 0.0
        return rollup


def rollup_keys(record: UsageRecord) -> list[tuple[str, int, str, str]]:
    """(window, start, dimension, key) of every rollup one record belongs to."""
    return [
        (window, window_start_ms(record.finished_at_ms, size), dimension, key)
        for window, size in WINDOWS_S.items()
        for dimension, key in (("user", record.user_id), ("model", record.model))
    ]


def counted_id(event: UsageRecord | FinalEvent) -> bytes:
    """What a record is known by once counted: a request's usage counts once whatever
    its attempts; a re-run counts once per attempt."""
    if isinstance(event, FinalEvent):
        return f"{event.request_id}#{event.attempt}".encode()
    return event.request_id.encode()


def restart_keys(final: FinalEvent) -> list[tuple[str, int, str, str]]:
    """The model rollups a re-run's final event belongs to (by when it finished)."""
    return [
        (window, window_start_ms(final.created_at_ms, size), "model", final.model)
        for window, size in WINDOWS_S.items()
    ]


def table_key(window: str, start_ms: int, dimension: str, key: str) -> str:
    return f"{dimension}/{key}/{window}/{start_ms}"
