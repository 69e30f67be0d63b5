"""Every few seconds, the in-flight records of this gateway's running replies that Redis
lost (restarted empty, or down when the reply claimed its conversation) are written
back (inflight.py, rerecord): stop and the one-reply-at-a-time rule read them."""

from __future__ import annotations

import asyncio
import logging

from producers.gateway.chat.inflight import InFlight
from tandoor.clients import REDIS_DOWN

log = logging.getLogger(__name__)

KEEP_S = 5.0  # one pipelined round trip per pass; a lost record is back within this


async def keep_records(inflight: InFlight, every_s: float = KEEP_S) -> None:
    while True:
        await asyncio.sleep(every_s)
        try:
            missing = await inflight.rerecord()
        except REDIS_DOWN as exc:
            log.debug("in-flight records not checked, Redis unreachable (%s)", exc)
            continue
        if missing:
            log.warning("%d running replies were missing from Redis: recorded again", missing)
