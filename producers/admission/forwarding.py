"""Admission's forwarding: waiting lines into each model's batch band, a tenant's turn
at a time (fairness.py), charged to its quota as they go, only while the band has
room; lines of a cancelled batch or past their window answered by a sweep."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial

from aiokafka.errors import KafkaError

from producers.admission.answers import UNREACHABLE, Unrun
from producers.admission.band_room import BandRoom
from producers.admission.fairness import FairQueue
from producers.admission.headers import BAD
from producers.admission.line_steps import RETRY_S, LineSteps
from producers.admission.sweep import answer_unrunnable
from producers.admission.waiting import Waiting
from producers.prompts import PromptSubmitter, PromptTooLarge
from schemas.events import now_ms
from tandoor.policies.quota import Admission, QuotaExceeded, Quotas, QuotaUnavailable
from tandoor.policies.redis_keys import quota_account
from tandoor.settings import Settings

log = logging.getLogger(__name__)

POLL_S = 0.25  # how often the batch band's backlog is measured
SWEEP_S = 1.0  # how often waiting lines are looked over for a cancel or a passed deadline
UNSENT_PER_PASS = 32  # lines of a model answered or held back before the next pass


class Forwarding(LineSteps):
    settings: Settings
    band: BandRoom
    queues: dict[str, FairQueue[Waiting]]
    quotas: Quotas
    submitter: PromptSubmitter
    _arrived: asyncio.Event
    _charged: dict[str, Admission]  # by request id: lines charged, not yet out
    _too_large: dict[str, str]  # by request id: Kafka refused it, its 413 not yet out
    _unwritable_until: dict[str, float]  # by model: its topic refused a line

    async def _forward_lines(self) -> None:
        swept_at = 0.0
        while not self._stopping.is_set():
            if time.monotonic() - swept_at >= SWEEP_S:
                more = await self._answer_unrunnable()
                swept_at = 0.0 if more else time.monotonic()  # more: after this pass
            for model, queue in self.queues.items():
                room, unsent = self.band.room(model) if self._writable(model) else 0, 0
                # Lines answered instead (cancelled, expired, key revoked) or held by a
                # quota are bounded per pass too: 50,000 of a cancelled batch, answered
                # one by one, held up the sweep and every other model for minutes.
                while room > 0 and unsent < UNSENT_PER_PASS and self._forwarding(model):
                    picked = queue.pop(time.monotonic())
                    if picked is None:
                        break
                    tenant, waiting = picked
                    if await self._until_done(partial(self._forward, queue, tenant, waiting)):
                        room -= 1
                    else:
                        unsent += 1
                self.metrics.waiting.labels(model).set(queue.size)
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), POLL_S)

    def _forwarding(self, model: str) -> bool:
        """Its topic took the last line: a failed try may take Kafka's request timeout
        (40 s), and the next tenant's line was tried at once, and the next."""
        return self._writable(model) and not self._stopping.is_set()

    def _writable(self, model: str) -> bool:
        """Not refused by Kafka in the last RETRY_S: retried in the same loop, one line
        of a topic that refuses writes held up every model's lines, and the sweep."""
        return time.monotonic() >= self._unwritable_until.get(model, 0.0)

    async def _answer_unrunnable(self) -> bool:
        """Waiting lines of a cancelled batch or past their deadline, answered now
        (sweep.py); True if more are due."""
        lines = [line for queue in self.queues.values() for line in queue.items()]
        answered, more = await answer_unrunnable(
            lines,
            self.marks,
            lambda line: self.queued.where(line.prompt.request_id) == line.position,
            self._refunded_unrun,
        )
        for queue in self.queues.values():
            queue.remove(lambda line: line.prompt.request_id in answered)
        return more

    async def _refunded_unrun(self, waiting: Waiting, why: Unrun) -> None:
        """Answered by the sweep: the charge of an earlier try refunded too (charged,
        Kafka refused it, then cancelled or expired while it waited for its retry)."""
        await self._refund(waiting.prompt.request_id)
        await self._answer_unrun(waiting, why)
        self._too_large.pop(waiting.prompt.request_id, None)

    async def _refund(self, request_id: str) -> None:
        if (charged := self._charged.pop(request_id, None)) is not None:
            await self.quotas.refund(charged)

    async def _forward(self, queue: FairQueue[Waiting], tenant: str, waiting: Waiting) -> bool:
        """Charge, produce, mark; False when the tenant is over its quota (it waits), or
        the line was answered instead."""
        prompt = waiting.prompt
        if self.queued.where(prompt.request_id) != waiting.position:
            self._charged.pop(prompt.request_id, None)  # the new owner charges it once
            self._too_large.pop(prompt.request_id, None)
            return False  # its partition was revoked meanwhile: the new owner has it
        if await self._answer_instead(queue, tenant, waiting):
            return False
        policy = self.settings.tiers[prompt.tier]
        try:
            admission = await self.quotas.admit(
                quota_account(prompt.user_id, prompt.tier),
                policy,
                prompt.request_id,
                prompt.charged_tokens,
                now_ms(),
                holds_stream=False,
            )
        except (QuotaExceeded, QuotaUnavailable) as exc:
            queue.put_back(tenant, waiting, time.monotonic() + exc.retry_after_s)
            return False
        self._charged[prompt.request_id] = admission  # refunded if answered instead
        # A retry is charged at its first time: the usage record settles that minute.
        # Admitted uncounted (Redis refused the charge): nothing there to settle, as the
        # gateway's prompts (settled, its estimate lowered a minute never charged).
        charged = prompt.charged_tokens if admission.counted else 0
        update = {"created_at_ms": admission.charged_at_ms, "charged_tokens": charged}
        admitted = prompt.model_copy(update=update)
        try:
            await self.submitter.submit(admitted)
        except PromptTooLarge as exc:  # refused on every try: answered, never retried
            self._too_large[prompt.request_id] = f"{exc}; shorten the messages"
            await self._answer_instead(queue, tenant, waiting)  # refunded
            return False
        except KafkaError as exc:  # its own topic (no leader, an ACL): its lines wait alone
            log.warning("%s: its topic refused %s (%r)", prompt.model, prompt.request_id, exc)
            queue.put_back(tenant, waiting, time.monotonic() + RETRY_S)  # charge kept
            self._unwritable_until[prompt.model] = time.monotonic() + RETRY_S
            return False
        self._charged.pop(prompt.request_id, None)
        await self._mark(prompt.request_id, waiting.position)
        queue.charge(tenant, prompt.charged_tokens)
        self.metrics.charged_tokens.labels(prompt.model).inc(prompt.charged_tokens)
        self.band.sent(prompt.model)
        self.queued.discard(prompt.request_id)  # gone already if revoked meanwhile
        self._done(waiting.partition, waiting.offset, "forwarded")
        return True

    async def _answer_instead(
        self, queue: FairQueue[Waiting], tenant: str, waiting: Waiting
    ) -> bool:
        """True if the line is not to run: answered, or put back until it can be."""
        try:
            answered = await self._answered_instead(waiting)
        except UNREACHABLE as exc:  # Cassandra: this answer waits, the others' lines go on
            log.warning("%s: not answered yet (%r)", waiting.prompt.request_id, exc)
            queue.put_back(tenant, waiting, time.monotonic() + RETRY_S)
            return True
        if answered:
            # A line answered counts as served: a tenant whose cancelled batch was answered
            # line by line kept the lowest counter, and took every turn until it was done.
            queue.charge(tenant, waiting.prompt.charged_tokens)
        return answered

    async def _answered_instead(self, waiting: Waiting) -> bool:
        """A line of a cancelled batch, past its window, whose key was revoked, or too
        large for Kafka: answered so, never run, and a charge of an earlier try refunded
        (charged, then Kafka away, then cancelled: it held its tenant back)."""
        request_id = waiting.prompt.request_id
        answer: Callable[[], Awaitable[None]]
        if (why := await self._why_unrun(waiting)) is not None:
            answer = partial(self._answer_unrun, waiting, why)
        elif (too_large := self._too_large.get(request_id)) is not None:
            answer = partial(self._answer_refused, waiting, 413, too_large, BAD)
        elif await self._key_revoked(waiting):
            answer = partial(self._answer_revoked, waiting)
        else:
            return False
        await self._refund(request_id)
        await answer()
        self._too_large.pop(request_id, None)
        return True
