"""Follows one reply from its subscription to its final event, whether or not a
client is still connected (closing the tab is not stop), then settles the quota.

A replica that shuts down stops following mid-reply and settles nothing: the reply
goes on in a worker, its client resumes on another replica, the streams app settles
the quota from the reply's usage record, and the in-flight record lapses once the
worker marks the request done."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TypeVar

from consumers.fanout import Delivered, Subscription
from schemas.events import FinalEvent

T = TypeVar("T")

log = logging.getLogger(__name__)

KEEPALIVE_S = 15.0
SETTLE_WAIT_S = 2.0
OnFinal = Callable[[FinalEvent | None], Awaitable[None]]


class ReplyWatch:
    def __init__(self, sub: Subscription, give_up_s: float, on_final: OnFinal) -> None:
        self.sub = sub
        self._give_up_s = give_up_s
        self._on_final = on_final
        self.final: FinalEvent | None = None  # once the reply has ended
        self.ending = False  # its end (a final, or giving up) is being settled, then sent
        # Events for the client; None marks the end (after a final, or on giving up).
        self._out: asyncio.Queue[Delivered | None] = asyncio.Queue()
        self.task = asyncio.create_task(self._follow(), name=f"reply-{sub.request_id}")

    def queued(self) -> bool:
        """Whether events are waiting for the client (they make frames without a wait)."""
        return not self._out.empty()

    async def events(self) -> AsyncIterator[Delivered | None]:
        """For the connected client: events, or None now and then as a keep-alive."""
        while True:
            try:
                item = await next_within(self._out, KEEPALIVE_S)
            except TimeoutError:
                yield None
                continue
            if item is None:
                return
            yield item

    async def _follow(self) -> None:
        last: Delivered | None = None  # the final event, with its place in Kafka
        final: FinalEvent | None = None
        try:
            while final is None:
                item = await next_within(self.sub.queue, self._give_up_s)
                if isinstance(item.event, FinalEvent):
                    last, final = item, item.event
                    self.final = final
                else:
                    self._out.put_nowait(item)
        except TimeoutError:
            log.warning("%s: no event for %.0f s; giving up", self.sub.request_id, self._give_up_s)
        except asyncio.CancelledError:
            self._out.put_nowait(None)
            raise  # the replica shuts down: not this replica's reply to settle any more
        # Settled before the client hears the end, so the request it sends next finds its
        # stream slot free and the conversation idle (no 429, no 409); a slow Redis delays
        # the end by SETTLE_WAIT_S at most, and settling then goes on behind it.
        self.ending = True
        settling = asyncio.create_task(self._settle(final))
        try:
            await asyncio.wait({settling}, timeout=SETTLE_WAIT_S)
        finally:  # cancelled meanwhile too: the client still gets its end
            if last is not None:
                self._out.put_nowait(last)
            self._out.put_nowait(None)
        await settling

    async def _settle(self, final: FinalEvent | None) -> None:
        try:
            await self._on_final(final)
        except Exception:  # settling must not kill the task; but say what was missed
            log.exception("%s: settling the finished reply failed", self.sub.request_id)


async def with_keepalives(
    events: AsyncIterator[T], keepalive_s: float, give_up_s: float
) -> AsyncGenerator[T | None, None]:
    """`events`, with None after each `keepalive_s` without one; it ends after
    `give_up_s` without one (a reply read back from Kafka whose worker is gone)."""
    source = aiter(events)
    step: asyncio.Future[T] | None = None
    try:
        while True:
            step = asyncio.ensure_future(anext(source))
            silent = 0.0
            while not (await asyncio.wait({step}, timeout=keepalive_s))[0]:
                silent += keepalive_s
                if silent >= give_up_s:
                    log.warning("no event for %.0f s; the resumed stream ends", silent)
                    return
                yield None
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            yield item
    finally:  # ended, or the client left: the reader goes with it
        if step is not None and not step.done():
            step.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await step
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            await aclose()


async def next_within(queue: asyncio.Queue[T], timeout_s: float) -> T:
    """The queue's next item, or TimeoutError after `timeout_s`. Per event of every
    stream: an item already there is taken without a timer, and the wait uses
    asyncio.timeout, not wait_for (which starts a task each time: a fifth of the
    gateway's time in the token path benchmark)."""
    if not queue.empty():
        return queue.get_nowait()
    async with asyncio.timeout(timeout_s):
        return await queue.get()
