"""Prometheus metrics of an inference worker, served on /metrics (tandoor.ops)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# Batch-band prompts may wait minutes behind interactive ones: the top buckets keep
# their quantiles from all landing in +Inf.
WAIT_BUCKETS = (*LATENCY_BUCKETS, 60, 300, 1800)


class WorkerMetrics:
    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model": model}
        self.waiting = Gauge(
            "tandoor_worker_requests_waiting",
            "Taken, no first token yet",
            ["model"],
            registry=self.registry,
        ).labels(**labels)
        self.running = Gauge(
            "tandoor_worker_requests_running",
            "Generating tokens",
            ["model"],
            registry=self.registry,
        ).labels(**labels)
        # Per band (the partition range the prompt came from: a handful, from the
        # settings), so interactive latency is not hidden under batch waits.
        self._ttft = Histogram(
            "tandoor_worker_time_to_first_token_seconds",
            "Prompt created to first token",
            ["model", "band"],
            buckets=WAIT_BUCKETS,
            registry=self.registry,
        )
        self._queue = Histogram(
            "tandoor_worker_queue_seconds",
            "Prompt created to the worker handing it to the engine",
            ["model", "band"],
            buckets=WAIT_BUCKETS,
            registry=self.registry,
        )
        self.tokens = Counter(
            "tandoor_worker_generated_tokens",
            "Completion tokens (rate() gives tokens/s)",
            ["model"],
            registry=self.registry,
        ).labels(**labels)
        self._finished = Counter(
            "tandoor_worker_requests_finished",
            "Final events by finish reason",
            ["model", "reason"],
            registry=self.registry,
        )
        self._lag = Gauge(
            "tandoor_worker_consumer_lag",
            "Prompts waiting in Kafka per band",
            ["model", "band"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "tandoor_worker_prompt_tokens",
            "Prompt tokens of finished requests",
            ["model"],
            registry=self.registry,
        ).labels(**labels)
        self.cached_tokens = Counter(
            "tandoor_worker_cached_prompt_tokens",
            "Of those, found in the prefix cache (cached / prompt = the hit rate)",
            ["model"],
            registry=self.registry,
        ).labels(**labels)
        self.usage_unsent = Gauge(
            "tandoor_worker_usage_unsent",
            "Usage records of replies that are out, not yet taken by Kafka (their prompts "
            "uncommitted): above 0 for long, the usage topic refuses writes",
            ["model"],
            registry=self.registry,
        ).labels(**labels)
        self._model = model

    def prompt(self, tokens: int, cached: int) -> None:
        self.prompt_tokens.inc(tokens)
        self.cached_tokens.inc(cached)

    def first_token(self, band: str, seconds: float) -> None:
        self._ttft.labels(model=self._model, band=band).observe(seconds)

    def queued(self, band: str, seconds: float) -> None:
        self._queue.labels(model=self._model, band=band).observe(seconds)

    def finished(self, reason: str) -> None:
        self._finished.labels(model=self._model, reason=reason).inc()

    def lag(self, backlog: dict[str, int]) -> None:
        for band, count in backlog.items():
            self._lag.labels(model=self._model, band=band).set(count)
