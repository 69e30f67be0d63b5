"""One prompt's life in a worker: checks, the engine, token events, the final event."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from schemas.events import (
    FinalEvent,
    FinishReason,
    PromptRequest,
    TokenEvent,
    Usage,
    UsageRecord,
    now_ms,
)
from workers.capacity import Capacity
from workers.coalesce import Coalescer
from workers.engine import Engine, RequestFailed
from workers.ledger import RequestLedger
from workers.metrics import WorkerMetrics
from workers.publisher import Publisher

log = logging.getLogger(__name__)

ENGINE_REASONS: dict[str | None, FinishReason] = {
    "stop": "stop",
    "length": "length",
    "abort": "cancelled",
}


@dataclass
class Tracked:
    """What a cancel needs to know about a request this worker holds."""

    request_id: str
    cancelled: bool = False
    in_engine: bool = False


@dataclass
class Attempt:
    """One attempt at a prompt, and what it produced so far."""

    prompt: PromptRequest
    tracked: Tracked
    number: int
    submitted_ms: float = 0.0
    first_token_ms: float | None = None
    last_token_ms: float = 0.0
    seq: int = 0
    text: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def expired(self) -> bool:
        deadline = self.prompt.deadline_ms
        return deadline is not None and now_ms() > deadline


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

    async def run(self, prompt: PromptRequest, tracked: Tracked) -> None:
        arrival = await self.ledger.arrive(prompt.request_id)
        if arrival.done:
            log.info("%s already has a final reply; skipping redelivery", prompt.request_id)
            return
        tracked.cancelled = tracked.cancelled or arrival.cancelled
        attempt = Attempt(prompt, tracked, arrival.attempt)
        self.metrics.waiting.inc()
        try:
            await self._run(attempt)
        finally:
            started = attempt.first_token_ms is not None
            (self.metrics.running if started else self.metrics.waiting).dec()

    async def _run(self, attempt: Attempt) -> None:
        refusal = await self._refusal(attempt)
        if refusal is not None:
            await self._finish(attempt, *refusal)
            return
        token_ids = self.engine.render_prompt(attempt.prompt.messages)
        attempt.prompt_tokens = len(token_ids)
        limit = self.engine.max_model_len
        if len(token_ids) >= limit:
            error = (
                f"prompt has {len(token_ids)} tokens; the context window of "
                f"{self.config.model} is {limit} tokens"
            )
            await self._finish(attempt, "error", error)
            return
        max_tokens = min(attempt.prompt.sampling.max_tokens, limit - len(token_ids))
        await self._generate(attempt, token_ids, max_tokens)

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
        if not await self.capacity.reserve_tokens(budget, give_up=lambda: tracked.cancelled):
            await self._finish(attempt, "cancelled", None)
            return
        try:
            if attempt.expired():
                await self._finish(attempt, "expired", "the deadline passed in the worker's queue")
                return
            try:
                reason = await self._stream(attempt, token_ids, max_tokens)
            except RequestFailed as exc:
                await self._finish(attempt, "error", f"generation failed: {exc}")
                return
            await self._finish(attempt, reason, None)
        finally:
            await self.capacity.release_tokens(budget)

    async def _stream(
        self, attempt: Attempt, token_ids: list[int], max_tokens: int
    ) -> FinishReason:
        request_id, tracked = attempt.prompt.request_id, attempt.tracked
        coalescer = Coalescer(self.config.coalesce_s, self.config.coalesce_tokens)
        sampling = attempt.prompt.sampling.model_copy(update={"max_tokens": max_tokens})
        attempt.submitted_ms = time.time() * 1000
        tracked.in_engine = True
        if tracked.cancelled:
            return "cancelled"
        reason: FinishReason = "stop"
        aborted = False
        async for out in self.engine.generate(request_id, token_ids, sampling):
            if tracked.cancelled and not aborted:  # the cancel came before the engine knew it
                aborted = True
                await self.engine.abort(request_id)
            self._count(attempt, out.new_tokens, out.cached_tokens)
            chunk = coalescer.add(out.delta, out.new_tokens, time.time())
            if chunk is not None:
                await self._send_tokens(attempt, *chunk)
            if out.finished:
                reason = ENGINE_REASONS.get(out.finish_reason, "stop")
        rest = coalescer.flush(time.time())
        if rest is not None:
            await self._send_tokens(attempt, *rest)
        return reason

    def _count(self, attempt: Attempt, new_tokens: int, cached_tokens: int) -> None:
        attempt.cached_tokens = cached_tokens
        if not new_tokens:
            return
        now = time.time() * 1000
        if attempt.first_token_ms is None:
            attempt.first_token_ms = now
            self.metrics.waiting.dec()
            self.metrics.running.inc()
            self.metrics.ttft.observe(max(0.0, now - attempt.prompt.created_at_ms) / 1000)
        attempt.last_token_ms = now
        attempt.completion_tokens += new_tokens

    async def _send_tokens(self, attempt: Attempt, text: str, tokens: int) -> None:
        prompt = attempt.prompt
        event = TokenEvent(
            request_id=prompt.request_id,
            attempt=attempt.number,
            seq=attempt.seq,
            delta=text,
            token_count=tokens,
            created_at_ms=now_ms(),
        )
        attempt.seq += 1
        attempt.text.append(text)
        self.metrics.tokens.inc(tokens)
        await self.publisher.token(event, prompt.request_id, prompt.reply_partition)

    async def _finish(self, attempt: Attempt, reason: FinishReason, error: str | None) -> None:
        prompt = attempt.prompt
        final = FinalEvent(
            request_id=prompt.request_id,
            attempt=attempt.number,
            seq=attempt.seq,
            finish_reason=reason,
            error=error,
            text="".join(attempt.text),
            usage=_usage(attempt),
            model=prompt.model,
            user_id=prompt.user_id,
            tier=prompt.tier,
            conversation_id=prompt.conversation_id,
            kind=prompt.kind,
            created_at_ms=now_ms(),
            prompt_created_at_ms=prompt.created_at_ms,
            batch_id=prompt.batch_id,
            store=prompt.store,
        )
        await self.publisher.final(final, prompt.reply_partition)
        await self.ledger.mark_done(prompt.request_id, attempt.number)
        await self.publisher.usage(_usage_record(prompt, final))
        self.metrics.finished(reason)
        usage = final.usage
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


def _usage(attempt: Attempt) -> Usage:
    created = attempt.prompt.created_at_ms
    started = attempt.submitted_ms or time.time() * 1000
    first = attempt.first_token_ms
    return Usage(
        prompt_tokens=attempt.prompt_tokens,
        completion_tokens=attempt.completion_tokens,
        cached_tokens=attempt.cached_tokens,
        queue_ms=max(0.0, started - created),
        ttft_ms=None if first is None else max(0.0, first - created),
        decode_ms=0.0 if first is None else max(0.0, attempt.last_token_ms - first),
    )


def _usage_record(prompt: PromptRequest, final: FinalEvent) -> UsageRecord:
    usage = final.usage
    return UsageRecord(
        request_id=prompt.request_id,
        attempt=final.attempt,
        user_id=prompt.user_id,
        tier=prompt.tier,
        model=prompt.model,
        kind=prompt.kind,
        batch_id=prompt.batch_id,
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        queue_ms=usage.queue_ms,
        ttft_ms=usage.ttft_ms,
        duration_ms=max(0.0, final.created_at_ms - prompt.created_at_ms),
        finish_reason=final.finish_reason,
        finished_at_ms=final.created_at_ms,
        charged_tokens=prompt.charged_tokens,
        charged_at_ms=prompt.created_at_ms,
    )
