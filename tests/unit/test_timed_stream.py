"""A file download whose client stops reading (the gateway's download response, called
as the server calls it). A plain streaming response waited on the write for ever, holding
a chunk and the database page behind it: many such downloads pinned the replica's
memory. Reply streams had the write timeout already (tests/unit/test_streaming.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.types import Message

from producers.gateway.timed_stream import TimedStream


async def test_a_download_its_client_stops_reading_is_cut_off_and_its_reader_closed() -> None:
    closed = asyncio.Event()

    async def pages() -> AsyncIterator[bytes]:
        try:
            while True:
                yield b"x" * 1024
        finally:
            closed.set()  # the database reader behind it let go

    written: list[Message] = []

    async def stalled_client(message: Message) -> None:
        written.append(message)
        if message["type"] == "http.response.body":
            await asyncio.Event().wait()  # the socket's buffer is full, and stays so

    async def connected() -> Message:
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    download = TimedStream(pages(), 0.2, {}, "application/octet-stream")
    scope = {"type": "http", "client": ("127.0.0.1", 1), "asgi": {"spec_version": "2.4"}}
    await asyncio.wait_for(download(scope, connected, stalled_client), 30)  # a failure guard
    assert closed.is_set()
    assert [m["type"] for m in written] == ["http.response.start", "http.response.body"]
