"""The gateway's Prometheus metrics: every HTTP request by route, method and status,
with its latency (prometheus-fastapi-instrumentator), and what is open right now,
read when scraped rather than counted on the hot path."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_fastapi_instrumentator import Instrumentator

from consumers.fanout import ReaderCount
from producers.gateway.limits import REFUSED
from producers.gateway.services import Services
from producers.gateway.shedding import BUSY, SHED
from producers.gateway.streaming import StreamSlots

UNMETERED = ["/health", "/ready"]  # probes: frequent, and not what users do


class OpenNow(Collector):
    def __init__(self, slots: StreamSlots, services: Callable[[], Services | None]) -> None:
        self._slots = slots
        self._services = services

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "tandoor_gateway_open_streams", "Reply streams open on this replica", self._slots.open
        )
        yield GaugeMetricFamily(
            "tandoor_gateway_draining", "1 while shutting down", self._slots.draining.is_set()
        )
        deps = self._services()
        if deps is not None:
            yield GaugeMetricFamily(
                "tandoor_gateway_followed_replies",
                "Replies whose token events this replica routes",
                deps.chat.deps.fanout.following,
            )
            yield GaugeMetricFamily(
                "tandoor_gateway_token_readers",
                "Kafka consumers of token events open on this replica: the group member, "
                "one per partition lost with open streams, one per resumed stream",
                ReaderCount.open,
            )
            yield from self._load(deps)

    @staticmethod
    def _load(deps: Services) -> Iterator[Metric]:
        """The signals of load shedding and busy refusals (producers/gateway/shedding.py)."""
        backlog = GaugeMetricFamily(
            "tandoor_gateway_model_backlog",
            "Prompts waiting or being generated, per model and band, as this replica saw last",
            labels=["model", "band"],
        )
        workers = GaugeMetricFamily(
            "tandoor_gateway_model_workers",
            "Members of each model's worker group",
            labels=["model"],
        )
        for model in deps.load.models:
            load = deps.load.load(model)
            if load is None:  # unknown: not measured yet, or Kafka not answering
                continue
            for band, count in load.backlog.items():
                backlog.add_metric([model, band], count)
            workers.add_metric([model], load.workers)
        yield backlog
        yield workers


# The per-route latency histogram (the dashboard's p95 by route): the default stopped at
# 1 s, and an unstreamed completion waits for its whole reply.
LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def gateway_metrics(
    app: FastAPI, slots: StreamSlots, services: Callable[[], Services | None]
) -> CollectorRegistry:
    """Instrument `app`; the registry to serve on the ops port."""
    registry = CollectorRegistry()
    Instrumentator(
        should_group_status_codes=False,
        excluded_handlers=UNMETERED,
        registry=registry,
        should_exclude_streaming_duration=True,  # to the headers: a stream's length is not in it
    ).instrument(
        app,
        metric_namespace="tandoor",
        metric_subsystem="gateway",
        latency_lowr_buckets=LATENCY_BUCKETS_S,
    )
    registry.register(OpenNow(slots, services))
    registry.register(REFUSED)
    registry.register(BUSY)
    registry.register(SHED)
    return registry
