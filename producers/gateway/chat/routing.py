"""Which model answers a request, and the context it gets there."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from producers.gateway.chat.checks import OFF_LOOP_CHARS, ReplyChecks
from producers.gateway.errors import ApiError
from producers.gateway.shedding import ModelRouter
from schemas.events import ChatMessage
from tandoor.policies.context import Context
from tandoor.settings import BATCH_BAND


def batch_only(tier: str) -> ApiError:
    """A tier in the batch band asks as a batch: straight to the band, its prompts went
    past admission's fair share, and a flood of them held every tenant's batch lines."""
    return ApiError(
        403,
        f"tier {tier!r} runs in the batch band: submit its prompts as a batch (the Batches "
        "API, `tandoor batch` or the batch.requests topic), where each tenant gets a fair share",
        kind="permission_error",
        code="batch_tier",
    )


@dataclass(frozen=True)
class Request:
    tier: str
    model: str  # the one asked for
    asked: list[ChatMessage]
    max_tokens: int
    length_param: str  # the field the caller set max_tokens with, as refusals name it
    client_context: bool  # an API client's whole context: refused, never cut, if too long
    summary: str | None


async def route(router: ModelRouter, checks: ReplyChecks, request: Request) -> tuple[str, Context]:
    """`routed`, in a thread for a long request: counting its tokens takes milliseconds
    (98 ms for 32,000 characters with SmolLM2's tokenizer), which the replica's streams
    should not wait for, least of all for a request refused before any quota counts it."""
    chars = sum(len(message.content) for message in request.asked) + len(request.summary or "")
    if chars > OFF_LOOP_CHARS:
        return await asyncio.to_thread(routed, router, checks, request)
    return routed(router, checks, request)


def routed(router: ModelRouter, checks: ReplyChecks, request: Request) -> tuple[str, Context]:
    """The model that answers (busy: a 503, uncharged) and the context it gets; a
    context too long for the asked model, or for the tier's minute, is its 4xx. A
    fallback whose smaller window refuses the context is not shed to: that was a 400
    because of load (the chat page's history is cut to fit, as on any model)."""
    contexts: dict[str, Context] = {}

    def context_on(model: str) -> Context:
        if model not in contexts:
            contexts[model] = checks.context(
                model,
                request.asked,
                request.max_tokens,
                request.client_context,
                request.summary,
                request.tier,
                request.length_param,
            )
        return contexts[model]

    def takes(fallback: str) -> bool:
        try:
            context_on(fallback)
        except ApiError:
            return False
        return True

    # What can never pass is refused as such first: busy, it was a 503 to retry, and an
    # SDK retries it for ever.
    if checks.settings.tiers[request.tier].band == BATCH_BAND:
        raise batch_only(request.tier)
    router.served(request.model)
    asked = context_on(request.model)
    checks.affordable(request.tier, asked.prompt_tokens + request.max_tokens, request.length_param)
    model = router.answering(request.model, request.tier, takes)
    return model, context_on(model)
