"""Done marks for replies whose end Redis did not record (it was out of reach).

Paid tiers are served through a Redis outage, so such a reply's final goes out
unrecorded. Its prompt may be fetched again after Redis is back (a rebalance before its
offset was committed, behind a longer prompt): without a done mark, the lease lapsed and
the transcript stopped at the outage, a second attempt went on from there and sent a
second, different final, which replaced the stored reply the user had read. So once the
final and its usage record are out, the request is marked done (its lease given back in
the same step), or, Redis still away, kept and marked at the worker's lease rounds. What
is fetched again before then runs again: the outage's risk, as for any prompt taken
while Redis is away (workers/ledger.py)."""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis

from tandoor.clients import REDIS_DOWN
from tandoor.policies.redis_keys import (
    ATTEMPT_TTL_S,
    attempt_key,
    done_key,
    final_key,
    lease_key,
    reply_key,
)
from workers.ledger_scripts import DONE_LATE
from workers.script_batch import BatchedScript

log = logging.getLogger(__name__)

OWED_DONE_MAX = 100_000  # past this many, the oldest is let go (a day-long outage)
ROUND_SIZE = 1_000  # marks sent in one pipeline


class LateDoneMarks:
    def __init__(self, client: aioredis.Redis, owner: str, lease_ms: int) -> None:
        self._redis = client
        self._owner = owner
        self._lease_ms = lease_ms
        self._script = BatchedScript(client, client.register_script(DONE_LATE))
        self._owed: dict[str, int] = {}  # request id: attempt, oldest first
        self._sending = asyncio.Lock()  # a round at a time: each entry is sent once
        self._answering = True  # the last send reached Redis
        self._let_go = 0

    @property
    def owed(self) -> int:
        return len(self._owed)

    def owes(self, request_id: str) -> bool:
        return request_id in self._owed

    def owe(self, request_id: str, attempt: int) -> None:
        self._owed[request_id] = attempt
        self._bound()

    async def mark(self, request_id: str, attempt: int) -> None:
        """Mark it done now if Redis answered last time and no round is under way; else
        it waits for the next round. Never waits itself: replies ending in an outage
        each waited for Redis in turn, their prompts uncommitted meanwhile."""
        self.owe(request_id, attempt)
        if self._answering and not self._sending.locked():
            async with self._sending:
                await self._send([(request_id, attempt)])

    async def record(self) -> bool:
        """Send the oldest ROUND_SIZE owed marks; False when Redis did not answer."""
        async with self._sending:
            return await self._send(list(self._owed.items())[:ROUND_SIZE])

    async def record_all(self) -> None:
        """At a worker's stop: every owed mark, while Redis answers."""
        while self._owed and await self.record():
            pass

    async def _send(self, batch: list[tuple[str, int]]) -> bool:
        """One pipeline (BatchedScript: calls made together share it); False when Redis
        did not answer, the marks it did not take still owed."""
        batch = [(rid, attempt) for rid, attempt in batch if self._owed.get(rid) == attempt]
        if not batch:
            return True
        replies = await asyncio.gather(
            *(
                self._script(
                    keys=_keys(rid), args=[self._owner, attempt, self._lease_ms, ATTEMPT_TTL_S]
                )
                for rid, attempt in batch
            ),
            return_exceptions=True,
        )
        self._answering = True
        for (request_id, attempt), reply in zip(batch, replies, strict=True):
            if isinstance(reply, REDIS_DOWN):
                self._answering = False
            elif isinstance(reply, BaseException):
                raise reply
            else:
                if self._owed.get(request_id) == attempt:
                    del self._owed[request_id]
                _log_refused(request_id, int(reply))
        if not self._answering:
            log.warning("%d done marks owed until Redis answers", len(self._owed))
        return self._answering

    def _bound(self) -> None:
        if len(self._owed) <= OWED_DONE_MAX:
            return
        del self._owed[next(iter(self._owed))]
        self._let_go += 1
        if self._let_go == 1 or self._let_go % OWED_DONE_MAX == 0:
            log.warning(
                "%d replies that ended during the Redis outage will not be marked done: "
                "fetched again, they run again",
                self._let_go,
            )


def _keys(request_id: str) -> list[str]:
    """The keys DONE_LATE takes: lease, done, attempt, reply, final."""
    return [
        lease_key(request_id),
        done_key(request_id),
        attempt_key(request_id),
        reply_key(request_id),
        final_key(request_id),
    ]


def _log_refused(request_id: str, marked: int) -> None:
    if marked == 2:
        log.info("%s: marked done already (its end recorded, or another worker's)", request_id)
    elif marked == 0:
        log.warning(
            "%s: ended while Redis was away, and a later attempt took it before its end "
            "was recorded",
            request_id,
        )
