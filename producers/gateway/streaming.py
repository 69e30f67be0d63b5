"""Reply streams that cannot exhaust a replica: a capped number open at once, and a
client that stops reading is cut off instead of holding its stream forever.

Memory per stream is bounded by the reply itself (at most max_tokens of events), and a
resumed stream's by one fetch of its partition besides (consumers/fanout.py), so the
cap and the write timeout are what keep slow or stuck clients in check. A client
that was cut off can reconnect with Last-Event-ID and resume.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterable, Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from producers.gateway.chat.sse import KEEPALIVE
from producers.gateway.chat.watch import KEEPALIVE_S
from producers.gateway.errors import ApiError
from producers.gateway.timed_stream import TimedSend, TimedStream

log = logging.getLogger(__name__)


class Slot:
    """One open stream; given back once, however the stream ends."""

    def __init__(self, owner: StreamSlots, resumed_by: str | None = None) -> None:
        self._owner: StreamSlots | None = owner
        self._resumed_by = resumed_by
        self.draining = owner.draining

    def release(self) -> None:
        if self._owner is not None:
            self._owner.open -= 1
            if self._resumed_by is not None:
                self._owner.resumed[self._resumed_by] -= 1
                if self._owner.resumed[self._resumed_by] <= 0:
                    del self._owner.resumed[self._resumed_by]
            self._owner = None


class StreamSlots:
    """The replica's streams. A post's stream is capped per user by the tier's
    concurrent streams (the quota); a resume is charged nothing, so each user's resumes
    open here at once are capped too (`resumes_per_user`): one user filled the replica."""

    def __init__(self, limit: int, resumes_per_user: int = 4) -> None:
        self.limit = limit
        self.resumes_per_user = resumes_per_user
        self.open = 0
        self.resumed: Counter[str] = Counter()
        # Set at SIGTERM: resumable streams end so their clients resume on another
        # replica, and no new stream starts here.
        self.draining = asyncio.Event()

    def take(self, resumed_by: str | None = None) -> Slot:
        """A slot, or a 503 before anything is charged or produced (a 429 for a user
        resuming more streams than `resumes_per_user`)."""
        if self.draining.is_set():
            raise ApiError(
                503,
                "this gateway replica is shutting down; retry (another replica answers)",
                kind="service_unavailable",
                headers={"Retry-After": "1"},
            )
        if self.open >= self.limit:
            raise ApiError(
                503,
                f"this gateway replica has {self.limit} streams open, its limit; retry shortly",
                kind="service_unavailable",
                headers={"Retry-After": "2"},
            )
        if resumed_by is not None and self.resumed[resumed_by] >= self.resumes_per_user:
            raise ApiError(
                429,
                f"{self.resumes_per_user} resumed streams are open for you on this replica "
                "already; close one first",
                kind="rate_limit_error",
                headers={"Retry-After": "2"},
                code="rate_limit_exceeded",
            )
        self.open += 1
        if resumed_by is not None:
            self.resumed[resumed_by] += 1
        return Slot(self, resumed_by)

    @contextmanager
    def reserve(self, resumed_by: str | None = None) -> Iterator[Slot]:
        """A slot for a stream about to start, given back if starting it fails."""
        slot = self.take(resumed_by)
        try:
            yield slot
        except BaseException:
            slot.release()
            raise


DRAINED = b": this replica is shutting down; resume with Last-Event-ID\n\n"


class ReplyStream(TimedStream):
    """Server-sent events holding `slot` while open; a write that blocks for longer
    than `write_timeout_s` ends the stream (the reply itself goes on and is stored).

    A `resumable` stream also ends when the replica starts draining: its client resumes
    with Last-Event-ID elsewhere. One that cannot resume (the OpenAI API) runs to its end
    within the shutdown grace period.

    `queued` says whether more of the reply's events are already waiting: the frames
    made meanwhile go out in one write (a write costs the middleware stack and the
    socket, a quarter of the gateway's time per frame in bench/token_path.py). A frame
    is never held for an event still to come: an event that makes no frame (held by the
    redaction, a duplicate) comes as an empty chunk, and what is held goes out."""

    def __init__(
        self,
        content: AsyncIterable[str],
        slot: Slot,
        write_timeout_s: float,
        headers: Mapping[str, str],
        resumable: bool = True,
        queued: Callable[[], bool] = lambda: False,
        ending: Callable[[], bool] = lambda: False,
    ) -> None:
        super().__init__(content, write_timeout_s, headers, "text/event-stream")
        self.slot = slot
        self.resumable = resumable
        self.queued = queued
        # The reply's end is in (settled, then sent within SETTLE_WAIT_S): a drain lets
        # it finish, as its record may be released already and a resume find nothing.
        self.ending = ending

    async def stream_response(self, send: Send) -> None:
        """Starlette's, writing the frames made from waiting events together. Events that
        make no frame for KEEPALIVE_S (text the redaction holds: a count to 400 held
        1,490 of its 1,497 characters) send a keep-alive: nothing went over the wire,
        and the keep-alives, sent only when no event came, stopped too (a proxy's idle
        limit cut the stream)."""
        start = {"type": "http.response.start", "status": self.status_code}
        await send({**start, "headers": self.raw_headers})
        frames: list[bytes] = []
        clock = asyncio.get_running_loop().time
        written_at = clock()
        async for chunk in self.body_iterator:
            if chunk:  # empty: an event that made no frame; what is held goes out now
                frames.append(chunk.encode() if isinstance(chunk, str) else bytes(chunk))
            elif not frames and clock() - written_at >= KEEPALIVE_S:
                frames.append(KEEPALIVE.encode())
            if frames and not self.queued():
                await send(
                    {"type": "http.response.body", "body": b"".join(frames), "more_body": True}
                )
                frames.clear()
                written_at = clock()
        await send({"type": "http.response.body", "body": b"".join(frames), "more_body": False})

    async def _stream(self, scope: Scope, receive: Receive, send: Send, timed: TimedSend) -> None:
        if not self.resumable:
            await super()._stream(scope, receive, send, timed)
            return
        body = StreamingResponse.__call__(self, scope, receive, timed)
        if not await self._until_drained(body):
            await self._end_drained(timed, timed.started)  # a stalled client too

    async def _ended(self) -> None:
        self.slot.release()
        await super()._ended()

    async def _until_drained(self, body: Awaitable[None]) -> bool:
        """Stream `body`; False if draining cut it short."""
        streaming = asyncio.ensure_future(body)
        drained = asyncio.ensure_future(self.slot.draining.wait())
        try:
            await asyncio.wait({streaming, drained}, return_when=asyncio.FIRST_COMPLETED)
            if not streaming.done() and self.ending():
                await asyncio.wait({streaming})
        except BaseException:  # the client went away: the body goes too
            streaming.cancel()
            raise
        finally:
            drained.cancel()
        if streaming.done():
            streaming.result()  # its exceptions are the caller's
            return True
        streaming.cancel()
        await asyncio.gather(streaming, return_exceptions=True)
        return False

    async def _end_drained(self, send: Send, started: bool) -> None:
        """End the body cleanly: the client sees the stream close, not an error."""
        if not started:
            start = {"type": "http.response.start", "status": self.status_code}
            await send({**start, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": DRAINED, "more_body": False})
