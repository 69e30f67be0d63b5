"""Running the gateway under uvicorn with a graceful shutdown: at SIGTERM the replica
turns unready, stops taking streams and ends its resumable ones at once (their clients
resume with Last-Event-ID on another replica); what cannot resume gets the grace period
to finish; then connections close and the lifespan releases Kafka, Redis and Cassandra."""

from __future__ import annotations

import asyncio
import signal
from types import FrameType

import uvicorn

from producers.gateway.app import create_app
from producers.gateway.limits import bounded_protocol
from producers.gateway.streaming import StreamSlots
from tandoor.settings import Settings


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, slots: StreamSlots) -> None:
        super().__init__(config)
        self._slots = slots

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig in (signal.SIGTERM, signal.SIGINT):
            # A signal handler: hand the event to the loop rather than touch it here.
            asyncio.get_running_loop().call_soon_threadsafe(self._slots.draining.set)
        super().handle_exit(sig, frame)


def serve_gateway(settings: Settings, port: int) -> None:
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=port,
        http=bounded_protocol(settings.gateway_max_header_bytes),
        log_config=None,  # our handlers: same format, role and request id as every role
        log_level="info",
        timeout_graceful_shutdown=int(settings.gateway_drain_s),
    )
    DrainingServer(config, app.state.slots).run()
