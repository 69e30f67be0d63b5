"""Responses that stream to a client which may stop reading: a write that blocks for
longer than `write_timeout_s` ends the response, so a stalled client holds nothing for
ever (a reply's events, a file's pages and the database page behind them)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, Mapping
from types import AsyncGeneratorType

from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

log = logging.getLogger(__name__)


# A scope extension the gateway's protocol sets (limits.BoundedHttpToolsProtocol): drops
# the connection at once, unsent bytes and all.
ABORT = "tandoor.abort"


class ClientTooSlow(Exception):
    pass


class TimedSend:
    """`send`, raising ClientTooSlow when one write blocks for `timeout_s`."""

    def __init__(self, send: Send, timeout_s: float) -> None:
        self._send = send
        self._timeout_s = timeout_s
        self.started = False  # the response's start has been sent

    async def __call__(self, message: Message) -> None:
        self.started = True
        try:
            async with asyncio.timeout(self._timeout_s):  # no task per chunk
                await self._send(message)
        except TimeoutError:
            raise ClientTooSlow from None


class TimedStream(StreamingResponse):
    def __init__(
        self,
        content: AsyncIterable[str] | AsyncIterable[bytes],
        write_timeout_s: float,
        headers: Mapping[str, str],
        media_type: str,
    ) -> None:
        super().__init__(content, media_type=media_type, headers=headers)
        self.write_timeout_s = write_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._stream(scope, receive, send, TimedSend(send, self.write_timeout_s))
        except* ClientTooSlow:
            log.warning(
                "client %s stopped reading for %.0f s: stream closed",
                scope.get("client"),
                self.write_timeout_s,
            )
            # Closed, a socket with unsent bytes stays open until the client reads them,
            # which a stalled one never does: a descriptor and its buffers per cut-off.
            if abort := scope.get("extensions", {}).get(ABORT):
                abort()
        finally:
            await self._ended()

    async def _stream(self, scope: Scope, receive: Receive, send: Send, timed: TimedSend) -> None:
        await StreamingResponse.__call__(self, scope, receive, timed)

    async def _ended(self) -> None:
        await self._close_body()

    async def _close_body(self) -> None:
        """A body cut short (a client gone or too slow, a drain) waits at what it made:
        closed now, what it holds goes (a Kafka reader, a database page), not when the
        garbage collector finds it. One cancelled mid-step ended with that step."""
        body = self.body_iterator
        if isinstance(body, AsyncGeneratorType) and not body.ag_running:
            try:
                await body.aclose()
            except Exception:  # the stream is over: what failed in its cleanup is logged
                log.exception("closing a stream's body failed")
