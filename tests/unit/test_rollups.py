"""Rollup arithmetic, checked against numbers worked out by hand."""

from __future__ import annotations

import orjson

from schemas.events import FinalEvent, FinishReason, Usage, UsageRecord
from streams.rollups import Rollup, counted_id, restart_keys, rollup_keys, window_start_ms


def usage(
    request_id: str,
    *,
    prompt: int = 10,
    completion: int = 21,
    cached: int = 0,
    ttft: float | None = 100,
    duration: float = 1100,
    reason: FinishReason = "stop",
    at: int = 125_000,
) -> UsageRecord:
    return UsageRecord(
        request_id=request_id,
        attempt=1,
        user_id="ada",
        tier="plus",
        model="smollm2",
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_tokens=cached,
        queue_ms=1,
        ttft_ms=ttft,
        duration_ms=duration,
        finish_reason=reason,
        finished_at_ms=at,
    )


def test_counts_sums_and_outcomes() -> None:
    rollup = Rollup("1m", 120_000, "user", "ada")
    rollup.add(usage("a", cached=8))
    rollup.add(usage("b", prompt=5, completion=0, ttft=None, reason="error"))
    rollup.add(usage("c", completion=3, reason="cancelled", cached=4))
    s = rollup.summary()
    assert (s["requests"], s["prompt_tokens"], s["completion_tokens"]) == (3, 25, 24)
    assert s["cached_tokens"] == 12
    assert (s["errors"], s["stops"]) == (1, 1)
    assert s["end_ms"] == 180_000


def test_a_rollups_state_does_not_grow_with_its_requests() -> None:
    rollup = Rollup("1h", 0, "model", "smollm2")
    rollup.add(usage("first"))
    size = len(orjson.dumps(rollup.dump()))
    for i in range(50_000):
        rollup.add(usage(f"r{i}", ttft=i % 5000, duration=(i % 5000) + 1000))
    assert rollup.summary()["requests"] == 50_001
    # The same fields with larger numbers; a rollup that kept its ids was 1 MB by now.
    assert len(orjson.dumps(rollup.dump())) < size + 400


def test_percentiles_land_in_the_right_bucket() -> None:
    rollup = Rollup("1h", 0, "model", "smollm2")
    for i in range(100):  # TTFT 1..100 ms; 20 tokens decoded in 1 s: 20 tokens/s
        rollup.add(usage(f"r{i}", ttft=i + 1, duration=i + 1 + 1000))
    s = rollup.summary()
    p50, p95 = s["ttft_ms"]["p50"], s["ttft_ms"]["p95"]
    assert 50 <= p50 <= 50 * 1.25 and 95 <= p95 <= 95 * 1.25
    assert 20 <= s["decode_tokens_per_s"]["p50"] <= 25


def test_state_survives_a_round_trip() -> None:
    rollup = Rollup("1m", 120_000, "user", "ada", partition=3)
    rollup.add(usage("a", cached=3))
    rollup.offset = 41  # what a replay after a restart is known by
    again = Rollup.load(rollup.dump())
    assert again.summary() == rollup.summary()
    assert (again.partition, again.offset) == (3, 41)


def test_each_record_feeds_both_windows_of_both_dimensions() -> None:
    keys = rollup_keys(usage("a", at=3_725_000))
    assert sorted(keys) == [
        ("1h", 3_600_000, "model", "smollm2"),
        ("1h", 3_600_000, "user", "ada"),
        ("1m", 3_720_000, "model", "smollm2"),
        ("1m", 3_720_000, "user", "ada"),
    ]
    assert window_start_ms(59_999, 60) == 0


def test_re_runs_count_as_restarts() -> None:
    rollup = Rollup("1m", 0, "model", "smollm2")
    first, rerun = final_event("a", attempt=1), final_event("a", attempt=2)
    rollup.add_restart(first)  # a first attempt is no restart
    rollup.add_restart(rerun)
    assert rollup.summary()["restarts"] == 1
    assert counted_id(rerun) == b"a#2" and counted_id(usage("a")) == b"a"
    assert restart_keys(rerun) == [("1m", 0, "model", "smollm2"), ("1h", 0, "model", "smollm2")]


def final_event(request_id: str, attempt: int) -> FinalEvent:
    return FinalEvent(
        request_id=request_id,
        attempt=attempt,
        seq=3,
        finish_reason="stop",
        text="hi",
        usage=Usage(prompt_tokens=1, completion_tokens=1, queue_ms=0, decode_ms=0),
        model="smollm2",
        user_id="ada",
        tier="plus",
        conversation_id="c",
        created_at_ms=30_000,
    )


def test_a_quantile_past_the_last_bucket_is_the_largest_value_seen() -> None:
    # A batch line queued for two hours: its TTFT is not "about 180 s".
    rollup = Rollup("1h", 0, "model", "smollm2")
    rollup.add(usage("quick", ttft=100, duration=1100))
    rollup.add(usage("queued", ttft=7_200_000, duration=7_201_000))
    again = Rollup.load(orjson.loads(orjson.dumps(rollup.dump())))
    s = again.summary()
    assert s["ttft_ms"]["p99"] == 7_200_000
    assert 100 <= s["ttft_ms"]["p50"] <= 125


def test_a_record_with_an_infinite_speed_leaves_the_rollup_usable() -> None:
    """Three tokens decoded in a subnormal time: an infinite speed, stored as null (JSON
    has no infinity), then every read of the rollup, and the next record, raised a
    TypeError: the publish timer crashed the app, again at each restart."""
    rollup = Rollup("1m", 120_000, "user", "ada")
    rollup.add(usage("quick"))
    rollup.add(usage("subnormal", ttft=0.0, duration=1e-320, completion=3))
    again = Rollup.load(orjson.loads(orjson.dumps(rollup.dump())))
    again.add(usage("next"))
    s = again.summary()
    assert s["requests"] == 3
    assert 20 <= s["decode_tokens_per_s"]["p99"] <= 25, "the finite speeds only"


def test_a_rollup_stored_with_a_null_highest_value_loads() -> None:
    """What a changelog written before the fix holds."""
    rollup = Rollup("1m", 120_000, "user", "ada")
    rollup.add(usage("queued", ttft=7_200_000, duration=7_201_000))
    loaded = Rollup.load(rollup.dump() | {"speed_highest": None, "ttft_highest": None})
    loaded.add(usage("next"))
    assert loaded.summary()["requests"] == 2
