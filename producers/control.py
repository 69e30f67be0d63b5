"""Cancel a request from anywhere (gateway, CLI, batch tools)."""

from __future__ import annotations

import logging

import redis.asyncio as aioredis

from schemas import topics
from schemas.codec import encode
from schemas.events import ControlEvent, now_ms
from tandoor.clients import REDIS_DOWN, kafka_producer, redis_client
from tandoor.policies.redis_keys import CANCEL_TTL_S, cancel_key
from tandoor.renewing_producer import RenewingProducer
from tandoor.settings import Settings

log = logging.getLogger(__name__)


async def request_cancel(
    producer: RenewingProducer, client: aioredis.Redis, request_id: str, reason: str | None = None
) -> None:
    """Record the cancel in Redis first (a worker taking the prompt later drops it),
    then tell the workers that may be running it now: that much even with Redis down
    (its error skipped the control event, and a reply whose client went ran on to
    max_tokens for no one, holding a stream slot)."""
    try:
        await client.set(cancel_key(request_id), 1, ex=CANCEL_TTL_S)
    except REDIS_DOWN as exc:
        log.warning("%s: cancel not recorded (%r); told to running workers only", request_id, exc)
    event = ControlEvent(
        command="cancel", request_id=request_id, issued_at_ms=now_ms(), reason=reason
    )
    await producer.send_and_wait(topics.CONTROL, encode(event), key=request_id.encode())


async def cancel_request(settings: Settings, request_id: str, reason: str | None) -> None:
    """One-shot cancel with its own connections (the CLI's)."""
    client = redis_client(settings)
    try:
        async with kafka_producer(settings, client_id="cancel") as producer:
            await request_cancel(producer, client, request_id, reason)
    finally:
        await client.aclose()
