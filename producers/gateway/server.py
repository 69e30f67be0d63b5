"""Running the gateway under uvicorn with a graceful shutdown: at SIGTERM the replica
turns unready, stops taking streams and ends its resumable ones at once (their clients
resume with Last-Event-ID on another replica); it keeps its port open a moment longer,
answering /ready with 503, so a load balancer sees it leave before connections are
refused; what cannot resume gets the grace period to finish; then connections close and
the lifespan releases Kafka, Redis and Cassandra."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from types import FrameType
from typing import Any

import uvicorn

from producers.gateway.app import create_app
from producers.gateway.limits import bounded_protocol
from producers.gateway.streaming import StreamSlots
from tandoor.lifecycle import exit_if_fatal, fatal_error
from tandoor.settings import Settings

CANCELLED_REQUESTS_WAIT_S = 5.0  # a cancelled request's cleanup: Redis releases, a stop


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, slots: StreamSlots, unready_s: float) -> None:
        super().__init__(config)
        self._slots = slots
        self._unready_s = unready_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.lifespan = AfterRequests(self.lifespan, self.server_state.tasks)
        await super().shutdown(sockets)
        if fatal_error() is not None:  # exit 1 below, not by the signal fatal() raised
            self._captured_signals.clear()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig not in (signal.SIGTERM, signal.SIGINT) or self._slots.draining.is_set():
            super().handle_exit(sig, frame)  # a second signal: no more waiting
            return
        # A signal handler: hand the work to the loop rather than touch it here.
        loop = asyncio.get_running_loop()
        loop.call_soon_threadsafe(self._slots.draining.set)
        loop.call_soon_threadsafe(loop.call_later, self._unready_s, super().handle_exit, sig, frame)


class AfterRequests:
    """The lifespan's shutdown, once the requests uvicorn cancelled at the end of the
    grace period have ended: their cleanup starts background work (the stop of a reply
    its client can no longer read), which the app's shutdown then waits for before it
    closes Kafka. uvicorn sends the shutdown right after cancelling them."""

    def __init__(self, lifespan: Any, requests: set[asyncio.Task[None]]) -> None:
        self._lifespan = lifespan
        self._requests = requests

    async def shutdown(self) -> None:
        if requests := set(self._requests):
            await asyncio.wait(requests, timeout=CANCELLED_REQUESTS_WAIT_S)
        await self._lifespan.shutdown()


def serve_gateway(settings: Settings, port: int) -> None:
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=port,
        http=bounded_protocol(settings.gateway_max_header_bytes),
        log_config=None,  # our handlers: same format, role and request id as every role
        log_level=logging.getLogger().level,  # the role's (it logged each request at INFO)
        timeout_graceful_shutdown=int(settings.gateway_drain_s),
    )
    DrainingServer(config, app.state.slots, settings.gateway_unready_s).run()
    exit_if_fatal()
