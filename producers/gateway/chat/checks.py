"""What a reply must pass before its prompt is produced, as API errors: moderation of
the new message, the reply's length, the context budget, and the caller's quota."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace

from producers.gateway.chat.protocol import ReplyOptions
from producers.gateway.errors import ApiError, unavailable
from schemas.events import ChatMessage
from tandoor.models import tokenizer_file
from tandoor.policies.api_keys import Principal
from tandoor.policies.context import Context, ContextTooLong, Counter, ModelCounters, assemble
from tandoor.policies.moderation import Moderator, Verdict
from tandoor.policies.quota import Admission, QuotaExceeded, Quotas, QuotaUnavailable
from tandoor.settings import Settings

OFF_LOOP_CHARS = 16_384


class ReplyChecks:
    def __init__(self, settings: Settings, moderator: Moderator, quotas: Quotas) -> None:
        self.settings = settings
        self.moderator = moderator
        self.quotas = quotas
        models = settings.models.items()
        self.counters = ModelCounters(
            {name: tokenizer_file(model, settings.cache_dir) for name, model in models},
            templates={name: model.chat_template for name, model in models},
        )

    async def moderated(self, content: str, param: str = "content") -> str:
        """The message as the model may see it (redacted), or a 400 naming a blocked term
        and `param`, the field of the request that holds it."""
        (text,) = await self.all_moderated([(content, param)])
        return text

    async def all_moderated(self, messages: Sequence[tuple[str, str]]) -> list[str]:
        """Each message (its content, and the field that holds it) as `moderated` checks
        one. Long ones are checked in a thread, judged by their total: linear time still
        means milliseconds per megabyte, which the loop's other streams should not wait
        for (64 messages just under the limit each, checked on the loop, held it 0.9 s)."""
        contents = [content for content, _ in messages]
        if sum(map(len, contents)) > OFF_LOOP_CHARS:
            verdicts = await asyncio.to_thread(self._checked, contents)
        else:
            verdicts = self._checked(contents)
        for verdict, (_, param) in zip(verdicts, messages, strict=True):
            if not verdict.allowed:
                reason = verdict.reason or "blocked"
                raise ApiError(400, reason, kind="moderation_error", param=param)
        return [verdict.text for verdict in verdicts]

    def _checked(self, contents: list[str]) -> list[Verdict]:
        return [self.moderator.check_input(content) for content in contents]

    def max_tokens(self, caller: Principal, options: ReplyOptions, model: str) -> int:
        """The reply's length: as asked, within the tier's limit; when not asked, the
        default, at most half the model's window (a small window, 512 tokens, was all
        kept for the reply: every message of the chat page was refused as too long)."""
        limit = self.settings.tiers[caller.tier].max_reply_tokens
        if options.max_tokens is None:
            config = self.settings.models.get(model)  # None: a removed model, a 404 later
            half_window = config.max_model_len // 2 if config else limit
            return min(self.settings.reply_max_tokens, limit, half_window)
        if options.max_tokens > limit:
            asked = f"{options.length_param} {options.max_tokens}"
            raise ApiError(
                400,
                f"{asked} is above tier {caller.tier!r}'s limit of {limit}",
                param=options.length_param,
            )
        return options.max_tokens

    def context(
        self,
        model: str,
        asked: list[ChatMessage],
        max_tokens: int,
        client_context: bool,
        summary: str | None = None,
        tier: str | None = None,
        length_param: str = "max_tokens",
    ) -> Context:
        """The chat page's history is trimmed to fit, oldest first, under the configured
        system prompt, within the model's window and the tier's minute of tokens (a chat
        past the minute was a 413 at every turn, and nothing was cut to summarize). An
        API client sends the whole context itself, system prompt included: if it does
        not fit, it is refused, never silently cut."""
        system = None if client_context else self.settings.system_prompt
        window = self.settings.models[model].max_model_len
        if max_tokens >= window and not client_context:
            raise ApiError(
                400,
                f"{length_param} {max_tokens} leaves no room for the message in {model}'s "
                f"{window}-token context window",
                param=length_param,
            )
        too_long = ApiError(  # OpenAI's answer to a context that does not fit
            400,
            f"context_length_exceeded: the messages and {length_param} {max_tokens} need "
            f"more than the model's {window}-token context; send fewer messages or a "
            f"smaller {length_param}",
            param="messages",
            code="context_length_exceeded",
        )
        per_minute = None if tier is None else self.settings.tiers[tier].tokens_per_minute
        most = None if client_context else per_minute
        count = self.counters.counter(model)
        summary = None if client_context else summary  # an API client sends its own
        try:
            context = _with_summary(
                system, summary, asked, window, max_tokens, most, count, not client_context
            )
        except ContextTooLong as exc:
            if client_context:
                raise too_long from exc
            if tier is not None:  # past the tier's minute, not the window: said so
                self.affordable(tier, exc.needed + max_tokens, length_param)
            raise ApiError(413, str(exc), param="content") from exc
        if client_context and context.dropped:
            raise too_long
        return context

    def fits(self, model: str, system: str, content: str, max_tokens: int) -> bool:
        """Whether a prompt of `system` and one user message fits the model's window with
        `max_tokens` for the reply (a background job's, which nothing cuts for it)."""
        window = self.settings.models[model].max_model_len
        message = [ChatMessage(role="user", content=content)]
        try:
            assemble(system, message, window, max_tokens, self.counters.counter(model))
        except ContextTooLong:
            return False
        return True

    def affordable(self, tier: str, tokens: int, length_param: str = "max_tokens") -> None:
        """A request above the tier's whole minute of tokens never fits: a 413 now, not
        a 429 retried forever (nor a batch line held back for good). `length_param`: the
        field the caller set the reply's length with, as the refusal names it."""
        per_minute = self.settings.tiers[tier].tokens_per_minute
        if tokens > per_minute:
            raise ApiError(
                413,
                f"this request needs {tokens} tokens (its prompt and {length_param}); tier "
                f"{tier!r} allows {per_minute} a minute: send a shorter context or a "
                f"smaller {length_param}",
                param=length_param,
            )

    async def admit(self, caller: Principal, request_id: str, tokens: int, now: int) -> Admission:
        """Charge the caller's quota, or refuse with 413 (never fits), 429 (over it) or
        503 (unknowable)."""
        self.affordable(caller.tier, tokens)
        policy = self.settings.tiers[caller.tier]
        try:
            return await self.quotas.admit(caller.quota_account, policy, request_id, tokens, now)
        except QuotaUnavailable as exc:
            raise unavailable(
                f"quotas cannot be checked right now and tier {caller.tier!r} is not served "
                "without them",
                exc.retry_after_s,
            ) from exc
        except QuotaExceeded as exc:
            raise ApiError(
                429,
                f"{exc} for tier {caller.tier!r}; retry in {exc.retry_after_s} s",
                kind="rate_limit_error",
                param=exc.limit,
                headers={"Retry-After": str(exc.retry_after_s)},
                code="rate_limit_exceeded",
            ) from exc


def _with_summary(
    system: str | None,
    summary: str | None,
    asked: list[ChatMessage],
    window: int,
    max_tokens: int,
    most: int | None,
    count: Counter,
    alternating: bool,
) -> Context:
    """With the summary of earlier turns after the system prompt, or without it when the
    new message leaves it no room: it stands for history, which goes first (kept, it
    made a message that fits a 413)."""
    if summary:
        with_it = f"{system or ''}\n\nSummary of the earlier conversation: {summary}".strip()
        try:
            return replace(
                assemble(with_it, asked, window, max_tokens, count, most, alternating),
                summarized=True,
            )
        except ContextTooLong:
            pass
    return assemble(system, asked, window, max_tokens, count, most, alternating)
