"""An attempt at one request in a worker: what it has produced so far, and the events
and usage records built from that (workers/request.py runs it)."""

from __future__ import annotations

import asyncio
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
from tandoor.policies.redis_keys import batch_cancel_key
from workers.ledger import Recorded


@dataclass
class Tracked:
    """What a cancel needs to know about a request this worker holds."""

    request_id: str
    cancelled: bool = False
    in_engine: bool = False
    leased: bool = False  # renewed by the worker while it holds the request
    attempt: int = 0  # its number: a lapsed lease is taken again only by the latest
    lost: bool = False  # the lease went to another worker: stop, publish nothing
    delivered: bool = False  # its final is out: published by this worker, or found done
    unrecorded_final: bytes | None = None  # out without its done mark (late_done.py)
    done: asyncio.Event = field(default_factory=asyncio.Event)  # its handling ended here


class LeaseLost(RuntimeError):
    """Another worker took the request over (this one stalled past its lease)."""


@dataclass
class Attempt:
    """One attempt at a prompt, and what it produced so far."""

    prompt: PromptRequest
    tracked: Tracked
    number: int
    epoch: int  # the attempt whose text the events carry: a continuation keeps it
    carried: tuple[Recorded, ...] = ()  # published by the attempt this one continues
    trimmed: str = ""  # ending the carried text, trimmed off by the template (trimmed.py)
    begun: bool = False  # earlier attempts published part of the reply (carried or not)
    recording: bool = False  # each token event goes to the transcript first
    stale_transcript: bool = False  # a record failed: drop it as soon as Redis answers
    lease_asked: float = float("-inf")  # taken unleased: when it last asked (monotonic)
    arrived_at: float = field(default_factory=time.monotonic)  # when the ledger let it in
    band: str = ""  # the priority band it came from, for the latency metrics
    submitted_ms: float = 0.0
    first_token_ms: float | None = None
    last_token_ms: float = 0.0
    seq: int = 0
    text: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    deliveries: list[asyncio.Future[object]] = field(default_factory=list)
    usage_due: UsageRecord | None = None  # its final is out: this goes next

    def expired(self) -> bool:
        """Past the deadline to start; a reply already under way continues."""
        deadline = self.prompt.deadline_ms
        return not self.begun and deadline is not None and now_ms() > deadline

    def stops(self) -> bool:
        """Stopped, taken over, or past its deadline: answered without the engine."""
        return self.tracked.cancelled or self.tracked.lost or self.expired()

    def until_deadline_s(self) -> float | None:
        """When a wait should look at `expired` again (just past the deadline)."""
        deadline = self.prompt.deadline_ms
        return None if deadline is None else (deadline - now_ms()) / 1000 + 0.001


def token_event(request_id: str, entry: Recorded) -> TokenEvent:
    return TokenEvent(
        request_id=request_id,
        attempt=entry.epoch,
        seq=entry.seq,
        delta=entry.delta,
        token_count=entry.tokens,
        created_at_ms=now_ms(),
    )


def usage_of(attempt: Attempt) -> Usage:
    created = attempt.prompt.created_at_ms
    started = attempt.submitted_ms or time.time() * 1000
    first = attempt.first_token_ms
    return Usage(
        # Only a prompt given to the engine counts: one stopped, expired or refused
        # before is settled at nothing against its quota, as if never taken.
        # A continuation's prompt was given to the engine of the attempt it continues.
        prompt_tokens=attempt.prompt_tokens if attempt.submitted_ms or attempt.carried else 0,
        completion_tokens=attempt.completion_tokens,
        cached_tokens=attempt.cached_tokens,
        queue_ms=max(0.0, started - created),
        # A continuation's first token is not the reply's: that was the attempt's it
        # continues, whose time this worker does not know.
        ttft_ms=None if first is None or attempt.carried else max(0.0, first - created),
        decode_ms=0.0 if first is None else max(0.0, attempt.last_token_ms - first),
    )


def final_of(attempt: Attempt, reason: FinishReason, error: str | None) -> FinalEvent:
    """The attempt's final event: the whole reply, carried text included."""
    prompt = attempt.prompt
    return FinalEvent(
        request_id=prompt.request_id,
        attempt=attempt.epoch,
        seq=attempt.seq,
        finish_reason=reason,
        error=error,
        text="".join(attempt.text),
        usage=usage_of(attempt),
        model=prompt.model,
        user_id=prompt.user_id,
        tier=prompt.tier,
        conversation_id=prompt.conversation_id,
        kind=prompt.kind,
        created_at_ms=now_ms(),
        prompt_created_at_ms=prompt.created_at_ms,
        batch_id=prompt.batch_id,
        custom_id=prompt.custom_id,
        store=prompt.store,
        replaces=prompt.replaces,
    )


def usage_record(prompt: PromptRequest, final: FinalEvent) -> UsageRecord:
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
        cached_tokens=usage.cached_tokens,
        queue_ms=usage.queue_ms,
        ttft_ms=usage.ttft_ms,
        duration_ms=max(0.0, final.created_at_ms - prompt.created_at_ms),
        finish_reason=final.finish_reason,
        finished_at_ms=final.created_at_ms,
        charged_tokens=prompt.charged_tokens,
        charged_at_ms=prompt.created_at_ms,
    )


def since_created(prompt: PromptRequest, ms: float) -> float:
    """Seconds from the prompt's creation (clocks of two hosts: never negative)."""
    return max(0.0, ms - prompt.created_at_ms) / 1000


def batch_cancel_of(prompt: PromptRequest) -> str | None:
    """A batch line is cancelled with its batch too: one forwarded before the cancel
    and not started yet is not run."""
    if prompt.kind != "batch" or not prompt.batch_id:
        return None
    return batch_cancel_key(prompt.user_id, prompt.batch_id)


async def not_delivered(attempt: Attempt) -> str | None:
    """Why some token event of the attempt never reached Kafka, or None when all did."""
    results = await asyncio.gather(*attempt.deliveries, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    return f"{len(errors)} token events were not delivered: {errors[0]!r}" if errors else None
