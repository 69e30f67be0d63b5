"""What happens to a line of admission's besides forwarding: answered without running
(its batch cancelled or past its window, its key revoked, refused), marked in Redis
with where it was read, and counted done for the offset commit. A step is tried until
the stores let it finish: a line is never dropped."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from functools import partial

from producers.admission.answers import UNREACHABLE, Answers, Unrun, why_unrun
from producers.admission.marks import CallerCache, LineMarks
from producers.admission.metrics import AdmissionMetrics
from producers.admission.waiting import Waiting, WaitingLines
from schemas import topics
from schemas.batch import refused_output
from schemas.events import now_ms
from tandoor.offsets import OffsetTracker

log = logging.getLogger(__name__)

RETRY_S = 1.0  # a store failing: try the line again after this


class LineSteps:
    """The steps of a line's life that reading and forwarding share (role.py)."""

    answers: Answers
    callers: CallerCache
    marks: LineMarks
    metrics: AdmissionMetrics
    offsets: OffsetTracker
    queued: WaitingLines
    _stopping: asyncio.Event

    async def _answered_unrun(self, waiting: Waiting) -> bool:
        """A line of a cancelled batch, or one whose batch's window is over: answered
        so, and never run. False for a line that may still run."""
        why = await self._why_unrun(waiting)
        if why is not None:
            await self._answer_unrun(waiting, why)
        return why is not None

    async def _why_unrun(self, waiting: Waiting) -> Unrun | None:
        return await why_unrun(self.marks, waiting.prompt, now_ms())

    async def _answer_unrun(self, waiting: Waiting, why: Unrun) -> None:
        if await self._taken_by_a_worker(waiting):
            return
        await self.answers.unrun(waiting.prompt, why)
        await self._answered(waiting, why)

    async def _taken_by_a_worker(self, waiting: Waiting) -> bool:
        """Forwarded before a crash lost its mark, and taken: its worker answers it.
        Answered here as well, it had two answers under one id (a cancel, and the reply
        it was charged for), and a client keeping an id's first answer kept the cancel."""
        if not await self.marks.run_by_a_worker(waiting.prompt.request_id):
            return False
        await self._answered(waiting, "replayed")
        return True

    async def _key_revoked(self, waiting: Waiting) -> bool:
        """A line may wait hours (its tenant's quota): a key revoked meanwhile stops it.
        A key that cannot be looked up now (Cassandra down) raises, unless it was found
        good within the key store's minute (CallerCache.resolve_again): the line is put
        back until it can be checked, and the other lines go on."""
        return await self.callers.resolve_again(waiting.key) is None

    async def _answer_revoked(self, waiting: Waiting) -> None:
        message = "the API key was revoked before this line ran"
        await self._answer_refused(waiting, 401, message, "authentication_error", "invalid_api_key")

    async def _answer_refused(
        self, waiting: Waiting, status: int, message: str, kind: str, code: str | None = None
    ) -> None:
        if await self._taken_by_a_worker(waiting):
            return
        prompt = waiting.prompt
        output = refused_output(
            prompt.custom_id, prompt.request_id, status, message, kind, code=code
        )
        await self.answers.send(prompt.user_id, prompt.batch_id, output)
        await self._answered(waiting, "refused")

    async def _answered(self, waiting: Waiting, outcome: str) -> None:
        """A waiting line answered without running: marked, and no longer waiting."""
        await self._mark(waiting.prompt.request_id, waiting.position)
        self.queued.discard(waiting.prompt.request_id)
        self._done(waiting.partition, waiting.offset, outcome)

    async def _mark(self, request_id: str, position: str, first_only: bool = False) -> None:
        """After a line's answer or forward went out, only the mark is tried again: the
        whole step again would send it twice, every second while Redis stays full."""
        await self._until_done(partial(self.marks.mark, request_id, position, first_only))

    async def _until_done(self, step: Callable[[], Awaitable[object]]) -> bool:
        """Run `step` until the stores let it finish (a line is never dropped)."""
        while True:
            try:
                return bool(await step())
            except UNREACHABLE as exc:
                if self._stopping.is_set():
                    return False
                log.warning("batch line step failed (%r); retrying in %.0f s", exc, RETRY_S)
                await asyncio.sleep(RETRY_S)

    def _done(self, partition: int, offset: int, outcome: str) -> None:
        self.offsets.finished(topics.BATCH_REQUESTS, partition, offset)
        self.metrics.lines.labels(outcome).inc()
