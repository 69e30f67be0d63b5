"""What every worker must agree on about a request, kept in Redis: who generates it
now (its lease), what it published so far (its transcript), its attempt number,
whether it already has a final reply, and whether it was cancelled.

Lease: a worker generates a request only while it holds the request's lease, which it
renews while the request is in its hands and gives back when done or handed back.
Another worker that receives the prompt meanwhile (a rebalance moved the partition
while its old owner generates) waits: the owner either finishes (the request is done:
skip it) or its lease lapses (it died) and the waiting worker takes over. Every token
event is recorded under the lease before it is sent, so a worker that stalled past its
lease learns it at once and stops: two attempts never publish at the same time (one
that cannot reach Redis stops publishing once its lease may have lapsed). A
lease that lapsed with no one taking the request since (not done, no later attempt:
Redis restarted empty, or was out of reach past the lease) is taken again by its
holder, which goes on: nobody else will run the request, whose offset it holds. So is
one done by the holder's own FINISH whose answer was lost: that FINISH, sent again,
finds its own final there, which nobody is delivering (`finish`).

Transcript: the token events recorded, in `seq` order. A worker that takes a request
over continues the reply from them (workers/request.py) instead of starting over.

Redis unreachable: the worker keeps serving (the gateway admitted the prompt under
its tier's Redis-down policy, see tandoor/policies/quota.py). The prompt is taken as a
first attempt without a lease, which it takes as soon as Redis answers again (so a
redelivery waits for it, and its end is recorded); records that cannot be written stop
the transcript (the next attempt restarts the reply instead of continuing it). A reply
that ends unrecorded is marked done once its final is out and Redis answers
(workers/late_done.py), so that its prompt fetched again later is skipped. What is
lost while Redis stays away: a prompt redelivered after a worker crash or a rebalance
runs again as attempt 1 (clients skip what they already have by sequence number), and
a cancel reaches only the worker running the request (the control topic still works).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Literal

import orjson
import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from tandoor.clients import REDIS_DOWN
from tandoor.policies.redis_keys import (
    ATTEMPT_TTL_S,
    CANCEL_TTL_S,
    FINAL_TTL_S,
    REPLY_TTL_S,
    arrival_key,
    attempt_key,
    cancel_key,
    done_key,
    final_key,
    lease_key,
    reply_key,
)
from workers.late_done import LateDoneMarks
from workers.lease_clock import LeaseClock
from workers.ledger_scripts import ARRIVE, FINISH, FORGET, LATE, RECORD, RELEASE, RENEW
from workers.script_batch import BatchedScript

log = logging.getLogger(__name__)

RELEASED_S = 60.0  # a lease given back is not renewed again for this long

Recording = Literal["ok", "lost", "gap", "down"]


@dataclass(frozen=True)
class Recorded:
    """One token event as published: the next attempt republishes it as it was."""

    epoch: int  # the attempt whose text this is (a continuation keeps it)
    seq: int
    delta: str
    tokens: int

    def encode(self) -> bytes:
        return orjson.dumps([self.epoch, self.seq, self.delta, self.tokens])

    @classmethod
    def decode(cls, raw: bytes) -> Recorded:
        epoch, seq, delta, tokens = orjson.loads(raw)
        return cls(int(epoch), int(seq), str(delta), int(tokens))


@dataclass(frozen=True)
class Arrival:
    """The request is this worker's to run (with its lease, unless Redis is down)."""

    attempt: int  # 1 the first time; a worker taking it over gets the next number
    cancelled: bool
    leased: bool
    transcript: tuple[Recorded, ...] = ()  # what earlier attempts published


@dataclass(frozen=True)
class Finished:
    """A final reply exists; `final` is set when it may never have been delivered."""

    final: bytes | None


@dataclass(frozen=True)
class Busy:
    """Another worker holds the lease; it lapses within `wait_ms` unless renewed."""

    wait_ms: int


UNKNOWN_TEXT = Recorded(epoch=0, seq=-1, delta="", tokens=0)  # a transcript's only entry
UNLEASED = Arrival(attempt=1, cancelled=False, leased=False)


class RequestLedger:
    def __init__(self, client: aioredis.Redis, owner: str, lease_s: float) -> None:
        self._redis = client
        self.owner = owner
        self._lease_ms = max(1, round(lease_s * 1000))
        self._arrive = client.register_script(ARRIVE)
        self._record = BatchedScript(client, client.register_script(RECORD))
        self._finish = client.register_script(FINISH)
        self._forget = client.register_script(FORGET)
        self._renew = client.register_script(RENEW)
        self._late = client.register_script(LATE)
        self._release = client.register_script(RELEASE)
        # A renewal takes a lapsed lease back: one under way when a lease is given back
        # must not take it again (the next worker would wait out the lease).
        self._leases_changing = asyncio.Lock()
        self._released: dict[str, float] = {}  # request id: when (monotonic)
        self.leases = LeaseClock(lease_s)  # each time Redis says a lease is ours
        self.late_done = LateDoneMarks(client, owner, self._lease_ms)

    async def arrive(
        self, request_id: str, cancelled_by: str | None = None
    ) -> Arrival | Finished | Busy:
        """`cancelled_by`: another key that cancels the request too (its batch's)."""
        if self.late_done.owes(request_id):  # answered here, its done mark not yet sent
            return Finished(None)
        keys = [
            done_key(request_id),
            lease_key(request_id),
            attempt_key(request_id),
            cancel_key(request_id),
            reply_key(request_id),
            final_key(request_id),
            cancelled_by or cancel_key(request_id),
            arrival_key(request_id),
        ]
        args: list[str | int] = [self.owner, self._lease_ms, ATTEMPT_TTL_S, uuid.uuid4().hex]
        asked = time.monotonic()
        try:
            reply = await self._arrive(keys=keys, args=args)
        except REDIS_DOWN as exc:
            log.warning("%s: Redis unreachable (%s); taken as a first attempt", request_id, exc)
            return UNLEASED
        kind = reply[0].decode() if isinstance(reply[0], bytes) else reply[0]
        if kind == "done":
            return Finished(reply[1] if len(reply) > 1 else None)
        if kind == "busy":
            return Busy(max(0, int(reply[1])))
        self._released.pop(request_id, None)  # held again: renewed again
        self.leases.confirmed(request_id, asked)
        attempt, cancelled, entries = int(reply[1]), bool(reply[2]), reply[3]
        transcript = tuple(Recorded.decode(raw) for raw in entries)
        return Arrival(attempt, cancelled, leased=True, transcript=transcript)

    async def lease_late(self, request_id: str) -> Literal["ok", "lost", "down"]:
        """Lease a request taken while Redis did not answer (UNLEASED), unless another
        worker took it meanwhile ("lost") or it is done."""
        args: list[str | int] = [self.owner, UNLEASED.attempt, self._lease_ms, ATTEMPT_TTL_S]
        asked = time.monotonic()
        try:
            taken = int(await self._late(keys=_held_keys(request_id), args=args))
        except REDIS_DOWN as exc:
            log.warning("%s: still not leased, Redis unreachable (%s)", request_id, exc)
            return "down"
        return self._held(request_id, asked, bool(taken))

    async def record(self, request_id: str, attempt: int, entry: Recorded) -> Recording:
        """Add a token event to the transcript, before it is sent, if the lease is
        still ours (which renews it)."""
        keys = [*_held_keys(request_id), reply_key(request_id)]
        args: list[str | int | bytes] = [
            self.owner,
            attempt,
            self._lease_ms,
            entry.seq,
            entry.encode(),
            REPLY_TTL_S,
            UNKNOWN_TEXT.encode(),
        ]
        asked = time.monotonic()
        try:
            result = int(await self._record(keys=keys, args=args))
        except REDIS_DOWN as exc:
            log.warning("%s: transcript not recorded, Redis unreachable (%s)", request_id, exc)
            return "down"
        if result == -1:
            return "lost"
        self.leases.confirmed(request_id, asked)
        return "ok" if result == 1 else "gap"

    async def forget_transcript(
        self, request_id: str, attempt: int, begun: bool = False
    ) -> Literal["ok", "lost", "down"]:
        """The transcript no longer matches what was published: the next attempt
        restarts the reply rather than continue from it. `begun`: some of it went out,
        which the transcript goes on saying (UNKNOWN_TEXT), so that the next attempt
        does not answer "expired" to a reader who has part of it. "lost": the lease is
        another worker's now, and so is the transcript."""
        keys = [*_held_keys(request_id), reply_key(request_id)]
        marker = UNKNOWN_TEXT.encode() if begun else b""
        args: list[str | int | bytes] = [self.owner, attempt, self._lease_ms, marker, REPLY_TTL_S]
        asked = time.monotonic()
        try:
            return self._held(
                request_id, asked, bool(int(await self._forget(keys=keys, args=args)))
            )
        except REDIS_DOWN as exc:
            log.warning("%s: transcript not dropped, Redis unreachable (%s)", request_id, exc)
            return "down"

    async def holds(self, request_id: str, attempt: int) -> Literal["ok", "lost", "down"]:
        """Whether the lease is still ours (which renews it): what a record says besides,
        for an attempt that no longer records."""
        asked = time.monotonic()
        try:
            held = await self._renew(
                keys=_held_keys(request_id), args=[self.owner, attempt, self._lease_ms]
            )
        except REDIS_DOWN as exc:
            log.warning("%s: lease not checked, Redis unreachable (%s)", request_id, exc)
            return "down"
        return self._held(request_id, asked, bool(int(held)))

    def _held(self, request_id: str, asked: float, held: bool) -> Literal["ok", "lost"]:
        if held:
            self.leases.confirmed(request_id, asked)
        return "ok" if held else "lost"

    async def finish(
        self, request_id: str, attempt: int, final: bytes
    ) -> Literal["ok", "lost", "down"]:
        """Mark the request done and keep its final until it is delivered. "lost": the
        lease was lost (another worker has the request: publish nothing). "down": the
        final goes out unrecorded, and `delivered_unrecorded` marks it done after. "ok"
        too for this call sent again: nothing is written (the final may be delivered
        by now), and a lapsed lease is taken back where its final waits unclaimed."""
        keys = [*_held_keys(request_id), final_key(request_id), reply_key(request_id)]
        args: list[str | int | bytes] = [self.owner, attempt, self._lease_ms, final]
        args += [ATTEMPT_TTL_S, FINAL_TTL_S]
        asked = time.monotonic()
        try:
            return self._held(request_id, asked, bool(await self._finish(keys=keys, args=args)))
        except REDIS_DOWN as exc:
            log.warning("%s: done not recorded yet, Redis unreachable (%s)", request_id, exc)
            return "down"

    async def delivered(self, request_id: str) -> None:
        """The final reached Kafka: nothing is left to publish again."""
        try:
            await self._redis.delete(final_key(request_id))
        except REDIS_DOWN as exc:
            log.warning("%s: final kept, Redis unreachable (%s)", request_id, exc)
        await self.release(request_id)

    async def delivered_unrecorded(self, request_id: str, attempt: int) -> None:
        """A final (and usage) that went out unrecorded (Redis was away, or the attempt
        unleased) is out: the request is marked done and its lease given back in one
        step, or at a lease round once Redis answers (workers/late_done.py)."""
        self.late_done.owe(request_id, attempt)  # first: a stop may cancel what follows
        async with self._leases_changing:
            self._released[request_id] = time.monotonic()
            self.leases.forget(request_id)
        await self.late_done.mark(request_id, attempt)

    async def release(self, request_id: str) -> None:
        """Give the lease back (if it is still ours): another worker may take over now."""
        async with self._leases_changing:
            self._released[request_id] = time.monotonic()
            self.leases.forget(request_id)
            try:
                await self._release(keys=[lease_key(request_id)], args=[self.owner])
            except REDIS_DOWN as exc:
                log.warning(
                    "%s: lease kept until it lapses, Redis unreachable (%s)", request_id, exc
                )

    async def renew(self, held: dict[str, int]) -> set[str]:
        """Extend the leases of requests in hand (request id: attempt number); the ones
        that are no longer ours."""
        async with self._leases_changing:
            return await self._renew_held(held)

    async def _renew_held(self, held: dict[str, int]) -> set[str]:
        now = time.monotonic()
        self._released = {r: at for r, at in self._released.items() if now - at < RELEASED_S}
        held = {r: attempt for r, attempt in held.items() if r not in self._released}
        if not held:
            return set()
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for request_id, attempt in held.items():
                    await self._renew(
                        keys=_held_keys(request_id),
                        args=[self.owner, attempt, self._lease_ms],
                        client=pipe,
                    )
                answers = await pipe.execute()
        except REDIS_DOWN as exc:
            log.warning("leases not renewed, Redis unreachable (%s)", exc)
            return set()
        except NoScriptError as exc:  # restarted between the script check and the calls
            log.warning("leases not renewed, Redis lost its scripts (%s); loaded next time", exc)
            return set()
        return {
            rid
            for rid, ok in zip(held, answers, strict=True)
            if self._held(rid, now, bool(int(ok))) == "lost"
        }

    async def cancelled_by(self, key: str | None) -> bool:
        """Whether `key` (a batch's cancel) is set; False when Redis cannot say."""
        if key is None:
            return False
        try:
            return bool(await self._redis.exists(key))
        except REDIS_DOWN as exc:
            log.warning("Redis unreachable (%s); %s not checked", exc, key)
            return False

    async def mark_cancelled(self, request_id: str) -> None:
        try:
            await self._redis.set(cancel_key(request_id), 1, ex=CANCEL_TTL_S)
        except REDIS_DOWN as exc:
            log.warning("Redis unreachable (%s); cancel of %s not recorded", exc, request_id)


def _held_keys(request_id: str) -> list[str]:
    """The keys HELD reads: lease, done, attempt."""
    return [lease_key(request_id), done_key(request_id), attempt_key(request_id)]


def continuable(transcript: tuple[Recorded, ...]) -> tuple[Recorded, ...]:
    """The transcript if it is one attempt's events from seq 0 without a gap, else ()."""
    epochs = {entry.epoch for entry in transcript}
    in_order = all(entry.seq == i for i, entry in enumerate(transcript))
    return transcript if len(epochs) == 1 and in_order else ()
