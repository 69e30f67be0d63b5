"""A client that stops reading, on a real server with the gateway's protocol: cut off
after the write timeout, its connection goes too. Closed with bytes still unsent, the
socket stayed open until the client read them, which a stalled client never does: a
file descriptor and its buffers per cut-off, counted by no limit, and a drain that
waited for them."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Route

from infra.process import free_port
from producers.gateway.limits import bounded_protocol
from producers.gateway.timed_stream import TimedStream
from tests.waiting import eventually

WRITE_TIMEOUT_S = 0.5


def endless_app(ended: asyncio.Event) -> Starlette:
    async def frames() -> AsyncIterator[bytes]:
        try:
            while True:
                yield b"data: " + b"x" * 8192 + b"\n\n"
        finally:
            ended.set()

    async def stream(_: Request) -> TimedStream:
        return TimedStream(frames(), WRITE_TIMEOUT_S, {}, "text/event-stream")

    return Starlette(routes=[Route("/stream", stream)])


async def test_a_client_cut_off_for_not_reading_loses_its_connection() -> None:
    ended = asyncio.Event()
    port = free_port()
    config = uvicorn.Config(
        endless_app(ended),
        port=port,
        http=bounded_protocol(4096),
        log_level="critical",
        lifespan="off",
    )
    serving = uvicorn.Server(config)
    task = asyncio.create_task(serving.serve())
    client = socket.socket()
    try:
        await eventually(lambda: _now(serving.started), what="the server up", poll_s=0.01)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.setblocking(False)
        await asyncio.get_running_loop().sock_connect(client, ("127.0.0.1", port))
        client.sendall(b"GET /stream HTTP/1.1\r\nHost: gw\r\n\r\n")  # and never reads
        await asyncio.wait_for(ended.wait(), 60)  # the write timed out: cut off
        await eventually(
            lambda: _now(len(serving.server_state.connections)),
            lambda open_: open_ == 0,
            what="the stalled client's connection gone",
            idle_s=10,
        )
    finally:
        client.close()
        serving.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 60)


async def _now(value: object) -> object:
    return value
