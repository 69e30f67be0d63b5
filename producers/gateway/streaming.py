"""Reply streams that cannot exhaust a replica: a capped number open at once, and a
client that stops reading is cut off instead of holding its stream forever.

Memory per stream is bounded by the reply itself (at most max_tokens of events), so
the cap and the write timeout are what keep slow or stuck clients in check. A client
that was cut off can reconnect with Last-Event-ID and resume.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, Iterator, Mapping
from contextlib import contextmanager

from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from producers.gateway.errors import ApiError

log = logging.getLogger(__name__)


class ClientTooSlow(Exception):
    pass


class Slot:
    """One open stream; given back once, however the stream ends."""

    def __init__(self, owner: StreamSlots) -> None:
        self._owner: StreamSlots | None = owner

    def release(self) -> None:
        if self._owner is not None:
            self._owner.open -= 1
            self._owner = None


class StreamSlots:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0

    def take(self) -> Slot:
        """A slot, or a 503 before anything is charged or produced."""
        if self.open >= self.limit:
            raise ApiError(
                503,
                f"this gateway replica has {self.limit} streams open, its limit; retry shortly",
                kind="service_unavailable",
                headers={"Retry-After": "2"},
            )
        self.open += 1
        return Slot(self)

    @contextmanager
    def reserve(self) -> Iterator[Slot]:
        """A slot for a stream about to start, given back if starting it fails."""
        slot = self.take()
        try:
            yield slot
        except BaseException:
            slot.release()
            raise


class ReplyStream(StreamingResponse):
    """Server-sent events holding `slot` while open; a write that blocks for longer
    than `write_timeout_s` ends the stream (the reply itself goes on and is stored)."""

    def __init__(
        self,
        content: AsyncIterable[str],
        slot: Slot,
        write_timeout_s: float,
        headers: Mapping[str, str],
    ) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.slot = slot
        self.write_timeout_s = write_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def timed_send(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), self.write_timeout_s)
            except TimeoutError:
                raise ClientTooSlow from None

        try:
            await super().__call__(scope, receive, timed_send)
        except* ClientTooSlow:
            log.warning(
                "client %s stopped reading for %.0f s: stream closed",
                scope.get("client"),
                self.write_timeout_s,
            )
        finally:
            self.slot.release()
