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
from workers.engine import Engine
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
class Progress:
    """What one attempt produced so far."""

    attempt: int
    submitted_ms: float = 0.0
    first_token_ms: float | None = None
    last_token_ms: float = 0.0
    seq: int = 0
    text: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0


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
        if await self.ledger.is_done(prompt.request_id):
            log.info("%s already has a final reply; skipping redelivery", prompt.request_id)
            return
        progress = Progress(attempt=await self.ledger.begin_attempt(prompt.request_id))
        self.metrics.waiting.inc()
        try:
            await self._run_attempt(prompt, tracked, progress)
        finally:
            gauge = (
                self.metrics.waiting if progress.first_token_ms is None else self.metrics.running
            )
            gauge.dec()

    async def _run_attempt(
        self, prompt: PromptRequest, tracked: Tracked, progress: Progress
    ) -> None:
        refusal = await self._refusal(prompt, tracked)
        if refusal is not None:
            await self._finish(prompt, progress, *refusal)
            return
        token_ids = self.engine.render_prompt(prompt.messages)
        progress.prompt_tokens = len(token_ids)
        limit = self.engine.max_model_len
        if len(token_ids) >= limit:
            error = (
                f"prompt has {len(token_ids)} tokens; the context window of "
                f"{self.config.model} is {limit} tokens"
            )
            await self._finish(prompt, progress, "error", error)
            return
        max_tokens = min(prompt.sampling.max_tokens, limit - len(token_ids))
        await self._generate(prompt, tracked, progress, token_ids, max_tokens)

    async def _refusal(
        self, prompt: PromptRequest, tracked: Tracked
    ) -> tuple[FinishReason, str | None] | None:
        """A reason to answer without the engine, or None."""
        if prompt.model != self.config.model:
            return (
                "error",
                f"unknown model {prompt.model!r}; this worker serves {self.config.model!r}",
            )
        if tracked.cancelled or await self.ledger.is_cancelled(prompt.request_id):
            return "cancelled", None
        if prompt.deadline_ms is not None and now_ms() > prompt.deadline_ms:
            return "expired", f"the deadline passed {now_ms() - prompt.deadline_ms} ms ago"
        return None

    async def _generate(
        self,
        prompt: PromptRequest,
        tracked: Tracked,
        progress: Progress,
        token_ids: list[int],
        max_tokens: int,
    ) -> None:
        budget = len(token_ids) + max_tokens
        if not await self.capacity.reserve_tokens(budget, give_up=lambda: tracked.cancelled):
            await self._finish(prompt, progress, "cancelled", None)
            return
        try:
            if prompt.deadline_ms is not None and now_ms() > prompt.deadline_ms:
                await self._finish(prompt, progress, "expired", "the deadline passed in the queue")
                return
            reason = await self._stream(prompt, tracked, progress, token_ids, max_tokens)
            await self._finish(prompt, progress, reason, None)
        finally:
            await self.capacity.release_tokens(budget)

    async def _stream(
        self,
        prompt: PromptRequest,
        tracked: Tracked,
        progress: Progress,
        token_ids: list[int],
        max_tokens: int,
    ) -> FinishReason:
        coalescer = Coalescer(self.config.coalesce_s, self.config.coalesce_tokens)
        sampling = prompt.sampling.model_copy(update={"max_tokens": max_tokens})
        progress.submitted_ms = time.time() * 1000
        tracked.in_engine = True
        if tracked.cancelled:
            return "cancelled"
        reason: FinishReason = "stop"
        aborted = False
        async for out in self.engine.generate(prompt.request_id, token_ids, sampling):
            if tracked.cancelled and not aborted:  # the cancel came before the engine knew it
                aborted = True
                await self.engine.abort(prompt.request_id)
            now = time.time() * 1000
            if out.new_tokens and progress.first_token_ms is None:
                progress.first_token_ms = now
                self._first_token(prompt, now)
            progress.last_token_ms = now if out.new_tokens else progress.last_token_ms
            progress.completion_tokens += out.new_tokens
            progress.cached_tokens = out.cached_tokens
            chunk = coalescer.add(out.delta, out.new_tokens, now / 1000)
            if chunk is not None:
                await self._send_tokens(prompt, progress, *chunk)
            if out.finished:
                reason = ENGINE_REASONS.get(out.finish_reason, "stop")
        rest = coalescer.flush(time.time())
        if rest is not None:
            await self._send_tokens(prompt, progress, *rest)
        return reason

    def _first_token(self, prompt: PromptRequest, now: float) -> None:
        self.metrics.waiting.dec()
        self.metrics.running.inc()
        self.metrics.ttft.observe(max(0.0, now - prompt.created_at_ms) / 1000)

    async def _send_tokens(
        self, prompt: PromptRequest, progress: Progress, text: str, tokens: int
    ) -> None:
        event = TokenEvent(
            request_id=prompt.request_id,
            attempt=progress.attempt,
            seq=progress.seq,
            delta=text,
            token_count=tokens,
            created_at_ms=now_ms(),
        )
        progress.seq += 1
        progress.text.append(text)
        self.metrics.tokens.inc(tokens)
        await self.publisher.token(event, prompt.request_id, prompt.reply_partition)

    async def _finish(
        self, prompt: PromptRequest, progress: Progress, reason: FinishReason, error: str | None
    ) -> None:
        usage = _usage(prompt, progress)
        final = FinalEvent(
            request_id=prompt.request_id,
            attempt=progress.attempt,
            seq=progress.seq,
            finish_reason=reason,
            error=error,
            text="".join(progress.text),
            usage=usage,
            model=prompt.model,
            user_id=prompt.user_id,
            tier=prompt.tier,
            conversation_id=prompt.conversation_id,
            kind=prompt.kind,
            created_at_ms=now_ms(),
        )
        await self.publisher.final(final, prompt.reply_partition)
        await self.ledger.mark_done(prompt.request_id, progress.attempt)
        await self.publisher.usage(_usage_record(prompt, final))
        self.metrics.finished(reason)
        if error:
            log.warning("%s attempt %d: %s: %s", prompt.request_id, progress.attempt, reason, error)


def _usage(prompt: PromptRequest, progress: Progress) -> Usage:
    started = progress.submitted_ms or time.time() * 1000
    first = progress.first_token_ms
    return Usage(
        prompt_tokens=progress.prompt_tokens,
        completion_tokens=progress.completion_tokens,
        cached_tokens=progress.cached_tokens,
        queue_ms=max(0.0, started - prompt.created_at_ms),
        ttft_ms=None if first is None else max(0.0, first - prompt.created_at_ms),
        decode_ms=0.0 if first is None else max(0.0, progress.last_token_ms - first),
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
    )
