"""One prompt's life in a worker: its lease, checks, the engine, token events, the final.

A worker that takes a request over from one that died continues the reply: it
republishes the token events the transcript holds (same attempt number and `seq`, so
readers skip what they already have), then gives the engine the prompt plus that text
as an unfinished assistant message and goes on from the next `seq`. The final carries
the whole text and counts every token of it once. Where the transcript does not match
(Redis lost part of it), the attempt starts the reply over under its own number and
readers show a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass

from schemas.codec import SchemaError, decode, encode
from schemas.events import (
    TOO_LONG_FOR_ENGINE,
    FinalEvent,
    FinishReason,
    PromptRequest,
    UsageRecord,
)
from workers.attempt import (
    Attempt,
    LeaseLost,
    Tracked,
    batch_cancel_of,
    final_of,
    not_delivered,
    since_created,
    token_event,
    usage_record,
)
from workers.capacity import Capacity
from workers.coalesce import Coalescer
from workers.engine import Engine, RequestFailed, finish_reason_of
from workers.ledger import Arrival, Busy, Finished, Recorded, RequestLedger, continuable
from workers.metrics import WorkerMetrics
from workers.publisher import Publisher
from workers.recording import fenced, lease_late, record, record_final_late
from workers.slot import NoSlot, Waiter
from workers.trimmed import LeadingWhitespace

log = logging.getLogger(__name__)
WAITED_S = 0.05  # a line held this long in the worker may have been cancelled meanwhile
NO_SLOT = NoSlot()


@dataclass(frozen=True)
class RunnerConfig:
    model: str
    coalesce_s: float
    coalesce_tokens: int


class RequestRunner:
    def __init__(
        self,
        config: RunnerConfig,
        engine: Engine,
        publisher: Publisher,
        ledger: RequestLedger,
        capacity: Capacity,
        metrics: WorkerMetrics,
    ) -> None:
        self.config = config
        self.engine = engine
        self.publisher = publisher
        self.ledger = ledger
        self.capacity = capacity
        self.metrics = metrics

    async def run(
        self, prompt: PromptRequest, tracked: Tracked, band: str, slot: Waiter = NO_SLOT
    ) -> None:
        """`band`: the priority band of the partition the prompt came from; `slot`: the
        engine slot its task holds, given back while another worker has the request."""
        arrival = await self._arrival(prompt, slot, tracked)
        if arrival is None:  # done: its final is out (delivered here now, or before)
            # Known so to a copy waiting on this task (asking Redis, down, it ran again).
            tracked.delivered = True
            return
        tracked.leased, tracked.attempt = arrival.leased, arrival.attempt
        tracked.cancelled = tracked.cancelled or arrival.cancelled
        attempt = await self._attempt(prompt, tracked, arrival)
        attempt.band = band
        self.metrics.waiting.inc()
        try:
            # Leased (renewed) meanwhile, released if handed back. A stop, a lost lease or a
            # passed deadline needs no engine: answered without a slot (full for minutes).
            if await slot.take_again(attempt.stops, attempt.until_deadline_s()):
                await self._run(attempt)
            elif tracked.lost:
                raise LeaseLost()
            else:
                await self._run(attempt)  # answered cancelled or expired (_refusal)
            if attempt.usage_due is not None:
                await self._send_usage(attempt.usage_due, slot)
                if tracked.unrecorded_final is not None:
                    tracked.unrecorded_final, tracked.leased = None, False  # the mark's now
                    await self.ledger.delivered_unrecorded(prompt.request_id, attempt.number)
                elif tracked.leased:
                    await self.ledger.delivered(prompt.request_id)
                tracked.leased = False  # delivered gave the lease back
                # Only now: a copy waiting on this task skips the prompt and commits it,
                # and one that skipped while the usage record failed lost that record.
                tracked.delivered = True
        except LeaseLost:
            log.warning(
                "%s: another worker took the request over; this attempt stops", prompt.request_id
            )
        finally:
            started = attempt.first_token_ms is not None
            (self.metrics.running if started else self.metrics.waiting).dec()
            if tracked.unrecorded_final is not None:  # stopped before its usage went out
                await record_final_late(self.ledger, attempt)
            if tracked.leased:
                await self.ledger.release(prompt.request_id)

    async def _arrival(
        self, prompt: PromptRequest, slot: Waiter, tracked: Tracked
    ) -> Arrival | None:
        """The request's lease, once no other worker holds it; None if it is done."""
        waited = False
        while True:
            outcome = await self.ledger.arrive(prompt.request_id, batch_cancel_of(prompt))
            if isinstance(outcome, Finished):
                if outcome.final is not None:  # its worker died before it was delivered
                    # Leased to deliver it, renewed: Kafka may hold the usage back for long.
                    tracked.leased = True
                    try:
                        await self._deliver_recorded(prompt, outcome.final, slot)
                    finally:
                        tracked.leased = False  # given back once delivered
                else:
                    log.info("%s already has a final reply; skipping redelivery", prompt.request_id)
                return None
            if not isinstance(outcome, Busy):
                return outcome
            if not waited:
                log.info("%s is in another worker's hands; waiting for it", prompt.request_id)
                await slot.give_back()
                waited = True
            await asyncio.sleep(min(max(outcome.wait_ms, 100), 1000) / 1000)

    async def _attempt(self, prompt: PromptRequest, tracked: Tracked, arrival: Arrival) -> Attempt:
        carried = continuable(arrival.transcript)
        if arrival.transcript and not carried:
            log.warning(
                "%s: the published text is not all known; restarting the reply", prompt.request_id
            )
            # Its text went out: the marker says so to an attempt after this one (which
            # would else answer "expired" past the deadline) until this one records.
            await self.ledger.forget_transcript(prompt.request_id, arrival.attempt, begun=True)
        epoch = carried[0].epoch if carried else arrival.attempt
        if carried:
            log.info(
                "%s attempt %d continues attempt %d after %d events",
                prompt.request_id,
                arrival.attempt,
                epoch,
                len(carried),
            )
        number, begun, leased = arrival.attempt, bool(arrival.transcript), arrival.leased
        return Attempt(prompt, tracked, number, epoch, carried, begun=begun, recording=leased)

    async def _deliver_recorded(self, prompt: PromptRequest, raw: bytes, slot: Waiter) -> None:
        """Publish a final that its worker recorded but may not have delivered."""
        try:
            final = decode(FinalEvent, raw)
        except SchemaError as exc:
            log.error("%s: recorded final unreadable (%s); dropped", prompt.request_id, exc)
        else:
            log.info("%s: delivering the final its worker recorded", prompt.request_id)
            await self.publisher.final(final, prompt.reply_partition)
            await self._send_usage(usage_record(prompt, final), slot)
        await self.ledger.delivered(prompt.request_id)

    async def _send_usage(self, record: UsageRecord, slot: Waiter) -> None:
        """The reply is out and the engine done with it: its slot is given back first, as
        Kafka may take long to accept the record (a partition with no leader), and each
        slot held meanwhile was one the engine lacked. Its prompt stays unfinished
        (uncommitted) until the record is sent: a worker stopped meanwhile leaves both
        to the next."""
        await slot.give_back()
        self.metrics.usage_unsent.inc()
        try:
            await self.publisher.usage(record)
        finally:
            self.metrics.usage_unsent.dec()

    async def _run(self, attempt: Attempt) -> None:
        await self._republish(attempt)
        refusal = await self._refusal(attempt)
        if refusal is not None:
            await self._finish(attempt, *refusal)
            return
        messages = attempt.prompt.messages
        partial = "".join(attempt.text)
        try:
            token_ids = prompt_ids = await self.engine.prompt_tokens(messages)
            if partial:
                token_ids, attempt.trimmed = await self.engine.continuation_tokens(
                    messages, partial
                )
        except RequestFailed as exc:
            await self._finish(attempt, "error", str(exc))
            return
        attempt.prompt_tokens = len(prompt_ids)
        limit = self.engine.max_model_len
        if attempt.prompt_tokens >= limit:
            error = (
                f"{TOO_LONG_FOR_ENGINE}{attempt.prompt_tokens} tokens; the context window of "
                f"{self.config.model} is {limit} tokens"
            )
            await self._finish(attempt, "error", error)
            return
        max_tokens = min(
            attempt.prompt.sampling.max_tokens - attempt.completion_tokens,
            limit - len(token_ids),
        )
        if max_tokens <= 0:  # the attempt it continues had used up the reply's budget
            await self._finish(attempt, "length", None)
            return
        await self._generate(attempt, token_ids, max_tokens)

    async def _republish(self, attempt: Attempt) -> None:
        """The events of the attempt this one continues, as they were (readers skip
        the ones they have): Kafka may have lost the last ones with their worker."""
        prompt = attempt.prompt
        for entry in attempt.carried:
            event = token_event(prompt.request_id, entry)
            attempt.deliveries.append(
                await self.publisher.token(event, prompt.request_id, prompt.reply_partition)
            )
            attempt.text.append(entry.delta)
            attempt.completion_tokens += entry.tokens
        attempt.seq = len(attempt.carried)
        if attempt.carried:  # its engine read the prompt: counted however this one ends
            with contextlib.suppress(RequestFailed):
                attempt.prompt_tokens = len(await self.engine.prompt_tokens(prompt.messages))

    async def _refusal(self, attempt: Attempt) -> tuple[FinishReason, str | None] | None:
        """A reason to answer without the engine, or None."""
        prompt = attempt.prompt
        if prompt.model != self.config.model:
            return (
                "error",
                f"unknown model {prompt.model!r}; this worker serves {self.config.model!r}",
            )
        if attempt.tracked.cancelled:
            return "cancelled", None
        if attempt.expired():
            return "expired", "the deadline passed before the worker took the prompt"
        return None

    async def _generate(self, attempt: Attempt, token_ids: list[int], max_tokens: int) -> None:
        budget = len(token_ids) + max_tokens
        tracked = attempt.tracked
        wake_in_s = attempt.until_deadline_s()
        if not await self.capacity.reserve_tokens(budget, attempt.stops, attempt.band, wake_in_s):
            if tracked.cancelled or tracked.lost:
                await self._finish(attempt, "cancelled", None)
            else:
                await self._finish(attempt, "expired", "the deadline passed in the worker's queue")
            return
        try:
            if attempt.expired():
                await self._finish(attempt, "expired", "the deadline passed in the worker's queue")
                return
            # Looked at on arrival only, a batch cancelled while its line waited here (for
            # a slot given back, for token budget) ran.
            waited = time.monotonic() - attempt.arrived_at > WAITED_S
            if waited and await self.ledger.cancelled_by(batch_cancel_of(attempt.prompt)):
                await self._finish(attempt, "cancelled", None)
                return
            try:
                reason = await self._stream(attempt, token_ids, max_tokens)
            except RequestFailed as exc:
                await self._finish(attempt, "error", f"generation failed: {exc}")
                return
            failed = "the engine failed the request" if reason == "error" else None
            await self._finish(attempt, reason, failed)
        finally:
            await self.capacity.release_tokens(budget, attempt.band)

    async def _stream(
        self, attempt: Attempt, token_ids: list[int], max_tokens: int
    ) -> FinishReason:
        request_id, tracked = attempt.prompt.request_id, attempt.tracked
        coalescer = Coalescer(self.config.coalesce_s, self.config.coalesce_tokens)
        untrimmed = LeadingWhitespace(attempt.trimmed)
        sampling = attempt.prompt.sampling.model_copy(update={"max_tokens": max_tokens})
        self._submitted(attempt)
        tracked.in_engine = True
        if tracked.cancelled:
            return "cancelled"
        reason: FinishReason = "stop"
        aborted, failed = False, None
        try:
            async with aclosing(self.engine.generate(request_id, token_ids, sampling)) as outputs:
                async for out in outputs:
                    if tracked.cancelled and not aborted:  # the cancel came before the engine
                        aborted = True
                        await self.engine.abort(request_id)
                    self._count(attempt, out.new_tokens, out.cached_tokens)
                    chunk = coalescer.add(untrimmed(out.delta), out.new_tokens, time.time())
                    if chunk is not None:
                        await self._send_tokens(attempt, *chunk)
                    if out.finished:
                        reason = finish_reason_of(out.finish_reason)
        except RequestFailed as exc:  # what it made before failing is the reply's, as charged
            failed = exc
        if (rest := coalescer.flush(time.time())) is not None:
            await self._send_tokens(attempt, *rest)
        if failed is not None:
            raise failed
        return reason

    def _submitted(self, attempt: Attempt) -> None:
        attempt.submitted_ms = time.time() * 1000
        if not attempt.carried:  # else it includes the earlier attempt's whole run
            self.metrics.queued(attempt.band, since_created(attempt.prompt, attempt.submitted_ms))

    def _count(self, attempt: Attempt, new_tokens: int, cached_tokens: int) -> None:
        attempt.cached_tokens = cached_tokens
        if not new_tokens:
            return
        now = time.time() * 1000
        if attempt.first_token_ms is None:
            attempt.first_token_ms = now
            self.metrics.waiting.dec()
            self.metrics.running.inc()
            if not attempt.carried:  # else the user's first token was the earlier attempt's
                self.metrics.first_token(attempt.band, since_created(attempt.prompt, now))
        attempt.last_token_ms = now
        attempt.completion_tokens += new_tokens

    async def _send_tokens(self, attempt: Attempt, text: str, tokens: int) -> None:
        prompt = attempt.prompt
        if attempt.tracked.lost:
            raise LeaseLost(prompt.request_id)
        entry = Recorded(attempt.epoch, attempt.seq, text, tokens)
        await self._record(attempt, entry)
        event = token_event(prompt.request_id, entry)
        attempt.seq += 1
        attempt.text.append(text)
        self.metrics.tokens.inc(tokens)
        delivery = await self.publisher.token(event, prompt.request_id, prompt.reply_partition)
        attempt.deliveries = [d for d in attempt.deliveries if not d.done() or d.exception()]
        attempt.deliveries.append(delivery)

    async def _record(self, attempt: Attempt, entry: Recorded) -> None:
        await record(self.ledger, attempt, entry)
        await fenced(self.ledger, attempt)

    async def _finish(self, attempt: Attempt, reason: FinishReason, error: str | None) -> None:
        prompt = attempt.prompt
        if attempt.tracked.lost:  # as for tokens: the ledger does not say so with Redis down
            raise LeaseLost(prompt.request_id)
        undelivered = await not_delivered(attempt)
        if undelivered is not None:  # readers miss text: say so, not end as if complete
            reason, error = "error", undelivered
        final = final_of(attempt, reason, error)
        await lease_late(self.ledger, attempt, throttled=False)
        encoded, recorded = encode(final), "down"
        if attempt.tracked.leased:
            recorded = await self.ledger.finish(prompt.request_id, attempt.number, encoded)
            if recorded == "lost":
                raise LeaseLost(prompt.request_id)
        attempt.tracked.unrecorded_final = encoded if recorded == "down" else None
        await fenced(self.ledger, attempt)  # finished unrecorded: Redis did not answer
        await self.publisher.final(final, prompt.reply_partition)
        attempt.usage_due = usage_record(prompt, final)  # sent once the engine is let go
        self.metrics.finished(reason)
        usage = final.usage
        self.metrics.prompt(usage.prompt_tokens, usage.cached_tokens)
        log.log(
            logging.WARNING if error else logging.INFO,
            "%s attempt %d %s: %d prompt + %d completion tokens, ttft %s ms%s",
            prompt.request_id,
            attempt.number,
            reason,
            usage.prompt_tokens,
            usage.completion_tokens,
            "-" if usage.ttft_ms is None else f"{usage.ttft_ms:.0f}",
            f": {error}" if error else "",
        )
