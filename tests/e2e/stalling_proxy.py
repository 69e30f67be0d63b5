"""A TCP relay in front of the gateway that can go silent, as a connection does when a
laptop sleeps or a NAT drops its mapping: neither end sees it close, and no more bytes
come. Armed with a marker, it silences the first response that carries it, right after
the event that does; every other connection relays as usual."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

CHUNK = 65536
EVENT_END = b"\n\n"


class StallingProxy:
    def __init__(self, gateway_url: str, marker: bytes) -> None:
        address = urlsplit(gateway_url)
        self.gateway = (address.hostname or "127.0.0.1", address.port or 80)
        self.marker = marker
        self.stalled = 0  # responses silenced
        self.url = ""
        self._writers: set[asyncio.StreamWriter] = set()

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[StallingProxy]:
        server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        try:
            yield self
        finally:
            server.close()
            for writer in self._writers:
                writer.close()

    async def _relay(
        self, from_client: asyncio.StreamReader, to_client: asyncio.StreamWriter
    ) -> None:
        from_gateway, to_gateway = await asyncio.open_connection(*self.gateway)
        self._writers |= {to_client, to_gateway}
        await asyncio.gather(
            self._requests(from_client, to_gateway),
            self._responses(from_gateway, to_client),
            return_exceptions=True,
        )
        for writer in (to_client, to_gateway):
            writer.close()
            self._writers.discard(writer)

    async def _requests(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        while data := await source.read(CHUNK):
            sink.write(data)
            await sink.drain()
        sink.close()

    async def _responses(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        received, sent, silent = b"", 0, False
        while data := await source.read(CHUNK):
            if silent:
                continue  # read and dropped: the gateway streams on, as into a dead link
            received += data
            upto = len(received)
            if not self.stalled and (at := received.find(self.marker)) >= 0:
                end = received.find(EVENT_END, at)
                if end < 0:
                    continue  # the rest of the marked event is still to come
                upto, silent = end + len(EVENT_END), True
                self.stalled += 1
            sink.write(received[sent:upto])
            sent = upto
            await sink.drain()
        if not silent:
            sink.close()
