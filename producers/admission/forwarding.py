"""Admission's forwarding: waiting lines into each model's batch band, a tenant's turn
at a time (fairness.py), charged to its quota as they go, only while the band has
room; lines of a cancelled batch or past their window answered by a sweep."""

from __future__ import annotations

import asyncio
import contextlib
import time
from functools import partial

from producers.admission.band_room import BandRoom
from producers.admission.fairness import FairQueue
from producers.admission.headers import BAD
from producers.admission.line_steps import LineSteps
from producers.admission.sweep import answer_unrunnable
from producers.admission.waiting import Waiting
from producers.prompts import PromptSubmitter, PromptTooLarge
from schemas.events import now_ms
from tandoor.policies.quota import QuotaExceeded, Quotas, QuotaUnavailable
from tandoor.settings import Settings

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

    async def _forward_lines(self) -> None:
        swept_at = 0.0
        while not self._stopping.is_set():
            if time.monotonic() - swept_at >= SWEEP_S:
                more = await self._answer_unrunnable()
                swept_at = 0.0 if more else time.monotonic()  # more: after this pass
            for model, queue in self.queues.items():
                room, unsent = self.band.room(model), 0
                # Lines answered instead (cancelled, expired, key revoked) or held by a
                # quota are bounded per pass too: 50,000 of a cancelled batch, answered
                # one by one, held up the sweep and every other model for minutes.
                while room > 0 and unsent < UNSENT_PER_PASS and not self._stopping.is_set():
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

    async def _answer_unrunnable(self) -> bool:
        """Waiting lines of a cancelled batch or past their deadline, answered now
        (sweep.py); True if more are due."""
        lines = [line for queue in self.queues.values() for line in queue.items()]
        answered, more = await answer_unrunnable(
            lines,
            self.marks,
            lambda line: self.queued.where(line.prompt.request_id) == line.position,
            self._answer_unrun,
        )
        for queue in self.queues.values():
            queue.remove(lambda line: line.prompt.request_id in answered)
        return more

    async def _forward(self, queue: FairQueue[Waiting], tenant: str, waiting: Waiting) -> bool:
        """Charge, produce, mark; False when the tenant is over its quota (it waits)."""
        prompt = waiting.prompt
        if self.queued.where(prompt.request_id) != waiting.position:
            return False  # its partition was revoked meanwhile: the new owner has it
        # A line answered counts as served: a tenant whose cancelled batch was answered
        # line by line kept the lowest counter, and took every turn until it was done.
        if await self._answered_unrun(waiting):
            queue.charge(tenant, prompt.charged_tokens)
            return False
        if await self._key_revoked(waiting):
            await self._answer_revoked(waiting)
            queue.charge(tenant, prompt.charged_tokens)
            return False
        policy = self.settings.tiers[prompt.tier]
        try:
            admission = await self.quotas.admit(
                prompt.user_id,
                policy,
                prompt.request_id,
                prompt.charged_tokens,
                now_ms(),
                holds_stream=False,
            )
        except (QuotaExceeded, QuotaUnavailable) as exc:
            queue.put_back(tenant, waiting, time.monotonic() + exc.retry_after_s)
            return False
        # A retry is charged at its first time: the usage record settles that minute.
        # Admitted uncounted (Redis refused the charge): nothing there to settle, as the
        # gateway's prompts (settled, its estimate lowered a minute never charged).
        charged = prompt.charged_tokens if admission.counted else 0
        update = {"created_at_ms": admission.charged_at_ms, "charged_tokens": charged}
        admitted = prompt.model_copy(update=update)
        try:
            await self.submitter.submit(admitted)
        except PromptTooLarge as exc:  # refused on every try: answered, never retried
            await self.quotas.refund(admission)
            await self._answer_refused(waiting, 413, f"{exc}; shorten the messages", BAD)
            queue.charge(tenant, prompt.charged_tokens)
            return False
        await self._mark(prompt.request_id, waiting.position)
        queue.charge(tenant, prompt.charged_tokens)
        self.metrics.charged_tokens.labels(prompt.user_id).inc(prompt.charged_tokens)
        self.band.sent(prompt.model)
        self.queued.discard(prompt.request_id)  # gone already if revoked meanwhile
        self._done(waiting.partition, waiting.offset, "forwarded")
        return True
