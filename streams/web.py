"""What the streams app serves on its web port: the rollups (behind the analytics
token: they hold every user's usage), and /metrics, /health and /ready."""

from __future__ import annotations

import hmac
from functools import partial

import faust
from faust.sensors.prometheus import setup_prometheus_sensors
from faust.web import Request, Response, View
from prometheus_client import CollectorRegistry, Gauge

from streams.tables import DIMENSIONS, RollupTables
from tandoor.ops import readiness_body


def install_pages(app: faust.App, rollups: RollupTables, token: str | None) -> None:
    """GET /rollups/<user|model>/<key>, and the ops pages."""

    @app.page("/rollups/{dimension}/{key}")
    class Rollups(View):
        async def get(self, request: Request, dimension: str, key: str) -> Response:
            refused = refusal(token, request.headers.get("Authorization"))
            if refused is not None:
                return self.json({"error": refused}, status=401)
            found = rollups.summaries(dimension, key)
            if found is None:
                expected = " or ".join(repr(d) for d in DIMENSIONS)
                error = f"dimension is {expected}, not {dimension!r}"
                return self.json({"error": error}, status=404)
            return self.json({"data": found})

    _install_ops_pages(app, rollups)


def _entries(rollups: RollupTables, table: str) -> int:
    return rollups.sizes()[table]


def refusal(token: str | None, authorization: str | None) -> str | None:
    """Why a rollups request is refused, or None if its bearer token is the analytics one."""
    if token is None:
        return "rollups over HTTP are off: set TANDOOR_ANALYTICS_TOKEN"
    scheme, _, given = (authorization or "").partition(" ")
    # As bytes: compare_digest refuses str with any non-ASCII character (a TypeError, a
    # 500 for any client that sent one).
    given_bytes = given.strip().encode("utf-8", "surrogateescape")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        given_bytes, token.encode("utf-8", "surrogateescape")
    ):
        return "send 'Authorization: Bearer <TANDOOR_ANALYTICS_TOKEN>'"
    return None


def metrics_registry(app: faust.App, rollups: RollupTables) -> CollectorRegistry:
    """faust's Prometheus sensors (events, lag, commits...; served by faust on /metrics)
    and the entries each table holds."""
    registry = CollectorRegistry()
    setup_prometheus_sensors(app, registry=registry, name_prefix="tandoor_streams")
    entries = Gauge(
        "tandoor_streams_table_entries",
        "Entries a rollup or counted-ids table holds in this process (bounded by time)",
        ["table"],
        registry=registry,
    )
    for table in rollups.sizes():
        entries.labels(table).set_function(partial(_entries, rollups, table))
    passed_over = Gauge(
        "tandoor_streams_passed_over",
        "Records (implausible counts, undecodable) or windows of records (late: their "
        "window was published closed and dropped) not counted since the process started",
        ["reason"],
        registry=registry,
    )
    for reason in ("implausible", "undecodable", "late"):
        passed_over.labels(reason).set_function(partial(rollups.passed_over.__getitem__, reason))
    return registry


def _install_ops_pages(app: faust.App, rollups: RollupTables) -> None:
    """/metrics (metrics_registry), /health, /ready."""
    metrics_registry(app, rollups)

    @app.page("/health")
    class Health(View):
        async def get(self, request: Request) -> Response:
            return self.json({"role": "streams", "status": "ok"})

    @app.page("/ready")
    class Ready(View):
        async def get(self, request: Request) -> Response:
            checks = {"kafka": bool(app.consumer.assignment()), "rebalanced": not app.rebalancing}
            ready = all(checks.values())
            return self.json(readiness_body("streams", ready, checks), status=200 if ready else 503)
