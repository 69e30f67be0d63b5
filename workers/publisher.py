"""Everything a worker writes to Kafka: token events, final events, usage, dead letters."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Awaitable, Callable

from aiokafka.errors import KafkaError, KafkaTimeoutError
from aiokafka.structs import ConsumerRecord

from schemas import topics
from schemas.codec import encode
from schemas.events import Event, FinalEvent, UsageRecord
from tandoor.clients import send_dead_letter
from tandoor.renewing_producer import RenewingProducer

log = logging.getLogger(__name__)
METADATA_WAIT_S = 10.0
ABSENT_RECHECK_S = 30.0  # a partition found missing is looked up again after this
RESEND_AFTER_S = (1.0, 2.0, 5.0, 10.0, 30.0)  # between tries of a final or usage, the last kept
FINAL_TRIES_S = 120.0  # a leader elected, a broker restarted: seconds; past this, not soon


class Publisher:
    def __init__(self, producer: RenewingProducer) -> None:
        self._producer = producer
        self._absent: dict[int, float] = {}  # partition -> when it was found missing

    async def token(
        self, event: Event, request_id: str, reply_partition: int | None
    ) -> asyncio.Future[object]:
        """Queue a token event; ordering with the final event is kept by the idempotent
        producer, so there is no need to wait for each delivery: the caller checks the
        returned deliveries before it sends the final."""
        partition = await self._reply_partition(reply_partition)
        delivery: asyncio.Future[object] = await self._producer.send(
            topics.TOKENS, encode(event), key=request_id.encode(), partition=partition
        )
        return delivery

    async def final(self, event: FinalEvent, reply_partition: int | None) -> None:
        """Deliver the final event (and so every token event before it) before returning,
        tried again for FINAL_TRIES_S: a `tokens` partition with no leader for a moment
        failed it, the worker stopped, and so did each worker the prompt went to next.
        Past that it raises (the worker stops): its slot and token budget are held
        meanwhile, unlike a usage record's, and a worker full of them takes nothing."""
        partition = await self._reply_partition(reply_partition)
        value, key = encode(event), event.request_id.encode()

        async def send() -> None:
            await self._producer.send_and_wait(topics.TOKENS, value, key=key, partition=partition)

        await _until_sent(send, f"{event.request_id}: final event", FINAL_TRIES_S)

    async def _reply_partition(self, wanted: int | None) -> int | None:
        """`wanted` where `tokens` has it. A partition this producer does not know yet
        (`tokens` grew and the gateway saw it first) is looked up once more; one that
        does not exist (a forged prompt) gives way to the key's hash, where persistence
        still reads it. aiokafka asserts on an unknown partition: that stopped the
        worker, and a malformed prompt never committed stopped every worker after it."""
        if wanted is None or wanted in await self._producer.partitions_for(topics.TOKENS):
            return wanted
        if time.monotonic() - self._absent.get(wanted, -ABSENT_RECHECK_S) < ABSENT_RECHECK_S:
            return None  # not again for each event of a forged prompt
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._producer.client.force_metadata_update(), METADATA_WAIT_S)
        if wanted in await self._producer.partitions_for(topics.TOKENS):
            return wanted
        log.warning("reply partition %d is not a partition of %s", wanted, topics.TOKENS)
        self._absent[wanted] = time.monotonic()
        return None

    async def usage(self, record: UsageRecord) -> None:
        """Sent once Kafka takes it, however long that is. Its final is out: a failure
        stopped the worker, and each worker the prompt went to next published the final
        again and stopped too (a `usage` partition with no leader). Until then the prompt
        is unfinished (its offset uncommitted): a worker stopped meanwhile leaves it to
        the next, which sends both again."""
        value, key = encode(record), record.user_id.encode()

        async def send() -> None:
            await self._producer.send_and_wait(topics.USAGE, value, key=key)

        await _until_sent(send, f"{record.request_id}: usage record")

    async def dead_letter(self, record: ConsumerRecord[bytes, bytes], reason: str) -> None:
        await send_dead_letter(self._producer, record, reason)


async def _until_sent(
    send: Callable[[], Awaitable[None]], what: str, within_s: float = float("inf")
) -> None:
    """`send` tried again through an outage that may end, for `within_s` at most; one
    refused for good (no ACL, too large) raises: the worker stops, loudly."""
    give_up_at = time.monotonic() + within_s
    for attempt in itertools.count(1):
        try:
            await send()
            return
        except KafkaError as exc:
            if not _passing(exc) or time.monotonic() >= give_up_at:
                raise
            wait_s = RESEND_AFTER_S[min(attempt, len(RESEND_AFTER_S)) - 1]
            log.warning("%s not sent (%r, try %d); again in %.0f s", what, exc, attempt, wait_s)
            await asyncio.sleep(wait_s)


def _passing(exc: KafkaError) -> bool:
    """An outage that may end: a retriable error, or a batch that expired waiting for a
    partition's leader (aiokafka's timeout, which it does not call retriable)."""
    return bool(exc.retriable) or isinstance(exc, KafkaTimeoutError)
