"""Prometheus metrics of the persistence consumer, served on /metrics (tandoor.ops)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

WRITE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class PersistMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.stored = Counter(
            "tandoor_persist_replies_stored",
            "Final events written to Cassandra (replays included)",
            registry=self.registry,
        )
        self.failed_writes = Counter(
            "tandoor_persist_write_failures",
            "Batches whose write failed and was retried",
            registry=self.registry,
        )
        self.send_failures = Counter(
            "tandoor_persist_send_failures",
            "Dead letters and batch results Kafka refused and that were sent again",
            registry=self.registry,
        )
        self.dead_lettered = Counter(
            "tandoor_persist_dead_lettered",
            "Final events that could not be stored and went to the dead-letter topic",
            registry=self.registry,
        )
        self.write_seconds = Histogram(
            "tandoor_persist_write_seconds",
            "Writing one fetched batch of final events",
            buckets=WRITE_BUCKETS,
            registry=self.registry,
        )
        self.lag = Gauge(
            "tandoor_persist_consumer_lag",
            "Token-stream records not yet read by this member (all its partitions)",
            registry=self.registry,
        )
