"""The worker's latency histograms are split by the band the prompt came from, so the
dashboards can show interactive latency apart from batch waits (workers/metrics.py)."""

from __future__ import annotations

from typing import Any, cast

from tests.unit.test_transcript_records import attempt
from workers.attempt import usage_of
from workers.ledger import Recorded
from workers.metrics import WorkerMetrics
from workers.request import RequestRunner, RunnerConfig


def test_first_token_is_observed_under_the_attempts_band() -> None:
    metrics = WorkerMetrics("m")
    unused = cast(Any, None)  # _count needs only the metrics
    runner = RequestRunner(RunnerConfig("m", 0.05, 16), unused, unused, unused, unused, metrics)
    current = attempt()
    current.band = "batch"
    metrics.waiting.inc()
    runner._count(current, 3, 0)
    runner._count(current, 2, 0)  # not a first token again
    count = "tandoor_worker_time_to_first_token_seconds_count"
    assert metrics.registry.get_sample_value(count, {"model": "m", "band": "batch"}) == 1
    assert (
        metrics.registry.get_sample_value(count, {"model": "m", "band": "interactive-paid"}) is None
    )
    assert metrics.registry.get_sample_value("tandoor_worker_requests_running", {"model": "m"}) == 1


def test_a_continued_reply_reports_no_time_to_first_token_or_queue_of_its_own() -> None:
    """Its first token was the attempt's it continues (a worker handed it back at
    SIGTERM, or died): timed from the prompt, each scale-in put replies of 20 s and more
    into the TTFT histogram and the usage stream, latency no user had."""
    metrics = WorkerMetrics("m")
    unused = cast(Any, None)
    runner = RequestRunner(RunnerConfig("m", 0.05, 16), unused, unused, unused, unused, metrics)
    continued = attempt()
    continued.carried = (Recorded(1, 0, "Hel", 1),)
    metrics.waiting.inc()
    runner._submitted(continued)
    runner._count(continued, 3, 0)
    band = {"model": "m", "band": continued.band}
    for histogram in ("time_to_first_token", "queue"):  # the queue: the whole earlier run
        assert (
            metrics.registry.get_sample_value(f"tandoor_worker_{histogram}_seconds_count", band)
            is None
        )
    assert metrics.registry.get_sample_value("tandoor_worker_requests_running", {"model": "m"}) == 1
    assert usage_of(continued).ttft_ms is None
    assert usage_of(continued).completion_tokens == 3


def test_queue_time_has_room_for_batch_waits() -> None:
    metrics = WorkerMetrics("m")
    metrics.queued("batch", 600)
    metrics.queued("interactive-paid", 0.2)
    bucket = "tandoor_worker_queue_seconds_bucket"
    batch = {"model": "m", "band": "batch"}
    assert metrics.registry.get_sample_value(bucket, {**batch, "le": "300.0"}) == 0
    assert metrics.registry.get_sample_value(bucket, {**batch, "le": "1800.0"}) == 1
    paid = {"model": "m", "band": "interactive-paid", "le": "0.25"}
    assert metrics.registry.get_sample_value(bucket, paid) == 1
