"""The gateway's server at shutdown, with a small app built from the gateway's own
pieces (the real gateway's drain: tests/e2e/test_operations.py).

A stream that cannot resume (the OpenAI API) and outlives the grace period is cancelled
by uvicorn, and its cleanup starts the stop of its reply in the background. uvicorn sent
the lifespan's shutdown right after cancelling: the app waited for the background work
it saw, none yet, and closed Kafka; the stop, started a moment later, never reached the
workers, and the reply ran on to max_tokens for no one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Route

from producers.gateway.openai_api.service import stopped_if_left
from producers.gateway.server import DrainingServer
from producers.gateway.streaming import ReplyStream, StreamSlots
from tandoor.background import Background
from tests.waiting import until


class Unended:
    final = None  # the reply never ends while its client reads


async def test_the_stop_of_a_stream_cut_at_the_end_of_the_grace_goes_before_the_app_closes() -> (
    None
):
    background, slots, happened = Background(), StreamSlots(4), []
    first_chunk_sent = asyncio.Event()

    async def send_stop() -> None:  # a produce to `control`
        happened.append("stop sent")

    async def chunks() -> AsyncIterator[str]:
        yield "data: one\n\n"
        first_chunk_sent.set()
        await asyncio.Event().wait()  # the reply goes on

    async def stream(request: Request) -> ReplyStream:
        body = stopped_if_left(chunks(), Unended(), lambda: background.start(send_stop()))  # type: ignore[arg-type]
        return ReplyStream(body, slots.take(), 10.0, {}, resumable=False)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await background.finish(5.0)
        happened.append("Kafka closed")

    app = Starlette(routes=[Route("/stream", stream)], lifespan=lifespan)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, timeout_graceful_shutdown=1)
    server = DrainingServer(config, slots, unready_s=0)
    serving = asyncio.create_task(server.serve())
    try:
        await until(lambda: server.started, what="the server started")
        port = server.servers[0].sockets[0].getsockname()[1]
        async with httpx.AsyncClient(timeout=30) as client:
            async with client.stream("GET", f"http://127.0.0.1:{port}/stream") as response:
                await first_chunk_sent.wait()
                server.should_exit = True  # as at SIGTERM, past the drain's unready moment
                await asyncio.wait_for(serving, 30)
    finally:
        server.should_exit = True
        await asyncio.gather(serving, return_exceptions=True)
    assert response.status_code == 200
    assert happened == ["stop sent", "Kafka closed"]
