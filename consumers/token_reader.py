"""Collecting the replies of known requests from the `tokens` topic."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Collection

from aiokafka import AIOKafkaConsumer

from schemas import topics
from schemas.codec import SchemaError, decode_token_stream
from schemas.events import FinalEvent, TokenEvent
from tandoor.clients import assign_from_end
from tandoor.settings import Settings

log = logging.getLogger(__name__)

IDLE_S = 120.0  # a wait fails after this long without any event on `tokens`


class TokenCollector:
    """Reads `tokens` from now on and keeps every event by request id: for tests and
    benchmarks (a bounded set of requests, not a live feed). Given `only`, the events of
    those requests alone are kept, and only theirs count as progress: `tandoor ask`
    against a live stack kept everyone's traffic, and never gave up while others'
    replies flowed."""

    def __init__(self, settings: Settings, only: Collection[str] | None = None) -> None:
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=settings.kafka_bootstrap,
            group_id=None,
            fetch_max_wait_ms=settings.fetch_wait_ms,
        )
        self.events: dict[str, list[TokenEvent | FinalEvent]] = defaultdict(list)
        self.arrival: dict[str, float] = {}  # request id -> monotonic time of its final
        self._seen: dict[int, float] = {}  # id(event) -> perf_counter when it arrived
        self._last_read = time.monotonic()  # progress: when any event last arrived
        self._task: asyncio.Task[None] | None = None
        self._only = only

    async def __aenter__(self) -> TokenCollector:
        await self._consumer.start()
        await assign_from_end(self._consumer, topics.TOKENS)
        self._task = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self._consumer.stop()

    async def _read(self) -> None:
        async for record in self._consumer:
            try:
                event = decode_token_stream(record.value)
            except SchemaError as exc:  # someone else's record: a tombstone, a newer schema
                log.warning("passed over tokens %s@%s: %s", record.partition, record.offset, exc)
                continue
            if self._only is not None and event.request_id not in self._only:
                continue
            self._seen[id(event)] = time.perf_counter()
            self._last_read = time.monotonic()
            self.events[event.request_id].append(event)
            if isinstance(event, FinalEvent):
                self.arrival[event.request_id] = time.monotonic()

    def arrival_of(self, event: TokenEvent | FinalEvent) -> float:
        """time.perf_counter() when `event` was read from Kafka."""
        return self._seen[id(event)]

    def finals(self, request_id: str) -> list[FinalEvent]:
        return [e for e in self.events[request_id] if isinstance(e, FinalEvent)]

    def tokens(self, request_id: str, attempt: int) -> list[TokenEvent]:
        return [
            e for e in self.events[request_id] if isinstance(e, TokenEvent) and e.attempt == attempt
        ]

    async def final(self, request_id: str, idle_s: float = IDLE_S) -> FinalEvent:
        await self.wait_for(lambda: bool(self.finals(request_id)), request_id, idle_s)
        return self.finals(request_id)[-1]

    async def first_token(self, request_id: str, idle_s: float = IDLE_S) -> TokenEvent:
        """Of whichever attempt: a worker that died before its first token carried
        nothing over, and the next attempt's events have a higher number."""
        await self.wait_for(lambda: bool(self._all_tokens(request_id)), request_id, idle_s)
        return self._all_tokens(request_id)[0]

    async def first_text(self, request_id: str, idle_s: float = IDLE_S) -> TokenEvent:
        """The first event with text: an opening event may carry none (a character the
        detokenizer has not finished), which a client does not count as a first token."""

        def with_text() -> list[TokenEvent]:
            return [e for e in self._all_tokens(request_id) if e.delta]

        await self.wait_for(lambda: bool(with_text()), request_id, idle_s)
        return with_text()[0]

    def _all_tokens(self, request_id: str) -> list[TokenEvent]:
        return [e for e in self.events[request_id] if isinstance(e, TokenEvent)]

    async def wait_for(
        self, condition: Callable[[], bool], what: str, idle_s: float = IDLE_S
    ) -> None:
        """Until `condition` holds; gives up only once `tokens` (the followed requests'
        events, given `only`) has been quiet for `idle_s`, so a slow engine that keeps
        producing is waited for, a stalled one not."""
        started = time.monotonic()
        while not condition():
            if self._task is not None and self._task.done():
                self._task.result()  # the reader's failure, not a wait to the idle limit
                raise RuntimeError("the reader of tokens stopped")
            quiet_s = time.monotonic() - max(started, self._last_read)
            if quiet_s > idle_s:
                raise TimeoutError(f"nothing arrived for {idle_s:.0f} s waiting for {what}")
            await asyncio.sleep(0.02)
