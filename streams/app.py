"""`tandoor streams`: faust-streaming agents that roll `usage` up per user and per
model, in one-minute and one-hour tumbling windows (by the time each request
finished), and count re-runs (a worker died mid-reply) from `tokens`.

`usage` is keyed by user, so the per-user table is filled straight from it; the
per-model table is filled from `<app id>-usage-by-model`, the same records keyed by
model. Tables live in memory with changelog topics in Kafka, so a restarted app
recovers them; a record replayed after a restart is recognised by its request id and
not counted again. The same records settle the tokens-per-minute quota in Redis with
the real usage, batch lines included. Every change is published to `usage.rollups` (keyed by rollup,
the latest message per key is current) and readable over HTTP:
`GET /rollups/user/<user>` and `GET /rollups/model/<model>`.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from operator import methodcaller
from typing import Any, TypeVar

import faust
import orjson
from faust.sensors.prometheus import setup_prometheus_sensors
from faust.web import Request, Response, View
from prometheus_client import CollectorRegistry

from producers.quota import Quotas, charged
from schemas import topics
from schemas.codec import SchemaError, decode
from schemas.events import Event, FinalEvent, UsageRecord
from streams.rollups import WINDOWS_S, Rollup, restart_keys, rollup_keys, table_key
from tandoor.clients import redis_client
from tandoor.ops import readiness_body
from tandoor.settings import Settings

log = logging.getLogger(__name__)
E = TypeVar("E", bound=Event)
USAGE_PARTITIONS = 4  # as declared in infra/topics.py: the tables are co-partitioned


Send = Callable[[bytes, bytes], Awaitable[Any]]  # (key, value)


@dataclass
class Outputs:
    """Where the agents write besides their tables; unit tests pass in-memory ones."""

    rollups: Send  # to usage.rollups
    by_model: Send  # the record again, keyed by model
    settle: Callable[[UsageRecord], Awaitable[None]]  # the tokens-per-minute quota


def create_app(settings: Settings, outputs: Outputs | None = None) -> faust.App:
    app = faust.App(
        settings.streams_app_id,
        broker=f"kafka://{settings.kafka_bootstrap}",
        store="memory://",
        autodiscover=False,
        datadir=str(settings.home / "streams"),
        web_enabled=True,
        web_bind=settings.host,
        web_host=settings.host,
        web_port=settings.streams_web_port,
        topic_partitions=USAGE_PARTITIONS,
        topic_replication_factor=settings.cassandra_replication_factor,
        producer_acks=-1,
        key_serializer="raw",
        value_serializer="raw",
        consumer_auto_offset_reset="earliest",
        broker_session_timeout=settings.streams_session_timeout_s,
    )
    usage = app.topic(topics.USAGE, key_type=bytes, value_type=bytes)
    tokens = app.topic(topics.TOKENS, key_type=bytes, value_type=bytes)
    by_model = app.topic(
        f"{settings.streams_app_id}-usage-by-model",
        key_type=bytes,
        value_type=bytes,
        partitions=USAGE_PARTITIONS,
        internal=True,
    )
    rollups_out = app.topic(topics.USAGE_ROLLUPS, key_type=bytes, value_type=bytes)
    out = outputs or _kafka_outputs(settings, by_model, rollups_out)
    tables = {
        dimension: app.Table(
            f"rollups-by-{dimension}",
            default=None,
            partitions=USAGE_PARTITIONS,
            key_type=bytes,
            value_type=bytes,  # orjson of Rollup.dump(), the app's raw serializer
        )
        for dimension in ("user", "model")
    }

    async def update(
        keys: list[tuple[str, int, str, str]], apply: Callable[[Rollup], bool]
    ) -> None:
        """Apply one record to each rollup it belongs to, and publish what changed."""
        for window, start, dim, key in keys:
            table = tables[dim]
            name = table_key(window, start, dim, key)
            stored = table.get(name.encode())
            rollup = (
                Rollup.load(orjson.loads(stored)) if stored else Rollup(window, start, dim, key)
            )
            if not apply(rollup):
                continue  # replayed after a restart: already counted
            table[name.encode()] = orjson.dumps(rollup.dump())
            expired = start - settings.streams_retention_windows * WINDOWS_S[window] * 1000
            table.pop(table_key(window, expired, dim, key).encode(), None)
            await out.rollups(name.encode(), orjson.dumps(rollup.summary()))

    async def count(dimension: str, record: UsageRecord) -> None:
        keys = [k for k in rollup_keys(record) if k[2] == dimension]
        await update(keys, methodcaller("add", record))

    @app.agent(usage, name="rollups-by-user")
    async def by_user_agent(stream: faust.StreamT[bytes]) -> None:
        async for payload in stream:
            record = _decoded(UsageRecord, payload)
            if record is not None:
                await count("user", record)
                await out.by_model(record.model.encode(), payload)
                await out.settle(record)

    @app.agent(tokens, name="restarts-from-tokens")
    async def restarts_agent(stream: faust.StreamT[bytes]) -> None:
        """From the token stream, the re-runs: final events of an attempt after the first
        (a worker died mid-reply). Token events are skipped without being parsed."""
        async for payload in stream:
            if b'"type":"final"' not in payload:
                continue
            final = _decoded(FinalEvent, payload)
            if final is not None and final.attempt > 1:
                await out.by_model(final.model.encode(), payload)

    @app.agent(by_model, name="rollups-by-model")
    async def by_model_agent(stream: faust.StreamT[bytes]) -> None:
        async for payload in stream:
            if b'"type":"final"' in payload:
                final = _decoded(FinalEvent, payload)
                if final is not None:
                    await update(restart_keys(final), methodcaller("add_restart", final))
                continue
            record = _decoded(UsageRecord, payload)
            if record is not None:
                await count("model", record)

    @app.page("/rollups/{dimension}/{key}")
    class Rollups(View):
        async def get(self, request: Request, dimension: str, key: str) -> Response:
            refused = _refusal(settings.analytics_token, request.headers.get("Authorization"))
            if refused is not None:
                return self.json({"error": refused}, status=401)
            table = tables.get(dimension)
            if table is None:
                return self.json(
                    {"error": f"dimension is 'user' or 'model', not {dimension!r}"}, status=404
                )
            prefix = f"{dimension}/{key}/".encode()
            found = [
                Rollup.load(orjson.loads(v)).summary()
                for k, v in table.items()
                if k.startswith(prefix)
            ]
            found.sort(key=lambda s: (s["window"], -s["start_ms"]))
            return self.json({"data": found})

    _install_ops_pages(app)
    return app


def _refusal(token: str | None, authorization: str | None) -> str | None:
    """Why a rollups request is refused, or None if its bearer token is the analytics one."""
    if token is None:
        return "rollups over HTTP are off: set TANDOOR_ANALYTICS_TOKEN"
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip(), token):
        return "send 'Authorization: Bearer <TANDOOR_ANALYTICS_TOKEN>'"
    return None


def _install_ops_pages(app: faust.App) -> None:
    """/metrics (faust's Prometheus sensors: events, lag, commits...), /health, /ready."""
    setup_prometheus_sensors(app, registry=CollectorRegistry(), name_prefix="tandoor_streams")

    @app.page("/health")
    class Health(View):
        async def get(self, request: Request) -> Response:
            return self.json({"role": "streams", "status": "ok"})

    @app.page("/ready")
    class Ready(View):
        async def get(self, request: Request) -> Response:
            checks = {
                "kafka": bool(app.consumer.assignment()),
                "rebalanced": not app.rebalancing,
            }
            ready = all(checks.values())
            return self.json(readiness_body("streams", ready, checks), status=200 if ready else 503)


def _kafka_outputs(settings: Settings, by_model: faust.TopicT, rollups: faust.TopicT) -> Outputs:
    quotas = Quotas(redis_client(settings))

    async def settle(record: UsageRecord) -> None:
        await settle_quota(quotas, record)

    return Outputs(
        rollups=lambda key, value: rollups.send(key=key, value=value),
        by_model=lambda key, value: by_model.send(key=key, value=value),
        settle=settle,
    )


async def settle_quota(quotas: Quotas, record: UsageRecord) -> None:
    """Settle the tokens-per-minute charge with the real usage (once per request,
    whoever comes first: this app, or the gateway that followed the reply)."""
    if record.charged_tokens and record.charged_at_ms is not None and record.user_id:
        admission = charged(
            record.user_id, record.request_id, record.charged_at_ms, record.charged_tokens
        )
        await quotas.settle(admission, record.prompt_tokens + record.completion_tokens)


def _decoded(model: type[E], payload: bytes) -> E | None:
    try:
        return decode(model, payload)
    except SchemaError as exc:
        log.error("skipping an undecodable %s: %s", model.__name__, exc)
        return None
