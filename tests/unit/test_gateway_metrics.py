"""What the gateway's own metrics measure: a route's latency is the time to its
headers, in buckets past a second, and a prompt shed to a fallback model is counted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import cast

from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient

from producers.gateway.metrics import gateway_metrics
from producers.gateway.services import Services
from producers.gateway.shedding import SHED
from producers.gateway.streaming import StreamSlots
from tests.unit.test_shedding import load, router

LONG_STREAM_S = 1.2  # past the default buckets' last bound, 1 s


def test_a_streams_latency_is_its_time_to_headers_and_a_slow_route_is_measured() -> None:
    """The whole stream was observed, in buckets ending at 1 s: every streaming route's
    p95 read as 1 s, flat, whatever the gateway did before its first byte."""
    app = FastAPI()
    registry = gateway_metrics(app, StreamSlots(1), lambda: cast(Services, None))

    async def slow_body() -> AsyncIterator[bytes]:
        await asyncio.sleep(LONG_STREAM_S)  # the reply generating, after the headers
        yield b"data: [DONE]\n\n"

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        return StreamingResponse(slow_body(), media_type="text/event-stream")

    assert TestClient(app).get("/stream").status_code == 200
    bucket = "tandoor_gateway_http_request_duration_seconds_bucket"
    within = registry.get_sample_value(bucket, {"handler": "/stream", "method": "GET", "le": "1.0"})
    assert within == 1.0
    assert (
        registry.get_sample_value(bucket, {"handler": "/stream", "method": "GET", "le": "30.0"})
        == 1.0
    )  # a slow unstreamed completion lands below +Inf too


def test_a_prompt_shed_to_the_fallback_is_counted() -> None:
    """Only an INFO line per request said so: nothing on /metrics or the dashboard."""
    shed = SHED.labels("big", "small", "backlog")
    before = shed._value.get()
    assert router({"big": load(waiting=96, rate=10)}).answering("big", "free") == "small"
    assert shed._value.get() == before + 1
