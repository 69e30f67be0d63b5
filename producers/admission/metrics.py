"""Prometheus metrics of the admission role, served on /metrics (tandoor.ops)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class AdmissionMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.lines = Counter(
            "tandoor_admission_lines",
            "Batch lines read, by outcome: forwarded, refused (answered with an error), "
            "defect (answered 500: reading it met a defect, logged), "
            "cancelled or expired (answered unrun: the batch cancelled, its window past), "
            "replayed (read again after a restart, already handled), unreadable (a record aiokafka "
            "cannot parse, skipped)",
            ["outcome"],
            registry=self.registry,
        )
        self.waiting = Gauge(
            "tandoor_admission_waiting_lines",
            "Lines read and waiting for room in the model's batch band",
            ["model"],
            registry=self.registry,
        )
        self.charged_tokens = Counter(
            "tandoor_admission_charged_tokens",
            # Not per tenant: the ops port is open, and per-user usage is the rollups'.
            "Tokens forwarded per model (prompt estimate + max_tokens), as charged",
            ["model"],
            registry=self.registry,
        )
