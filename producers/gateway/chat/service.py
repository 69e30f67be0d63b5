"""Posting a message: checks, quota, the user message stored, the prompt produced,
and the reply followed; stopping and resuming a reply."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import orjson
import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from consumers.fanout import Delivered, Subscription, TokenFanout, read_request
from producers.context import Context, ContextTooLong, assemble
from producers.control import request_cancel
from producers.gateway.chat.jobs import ConversationJobs
from producers.gateway.chat.protocol import PostMessage, ReplyOptions
from producers.gateway.chat.watch import ReplyWatch
from producers.gateway.conversations.protocol import (
    Conversation,
    ConversationWithMessages,
    Message,
)
from producers.gateway.conversations.service import ConversationService
from producers.gateway.errors import ApiError, not_found, unavailable
from producers.gateway.streaming import StreamSlots
from producers.keys import Principal
from producers.moderation import Moderator
from producers.prompts import PromptSubmitter
from producers.quota import Admission, QuotaExceeded, Quotas, QuotaUnavailable
from producers.shedding import ModelRouter
from schemas.events import ChatMessage, FinalEvent, PromptRequest, Sampling, now_ms
from schemas.keys import ATTEMPT_TTL_S, done_key
from tandoor.clients import REDIS_DOWN
from tandoor.settings import Settings

log = logging.getLogger(__name__)

INFLIGHT_TTL_S = 3600
QUEUE_RETRY_S = 2  # Kafka did not take the prompt: a broker restart takes seconds
REPLY_STATUSES = {"complete", "stopped"}


@dataclass
class Reply:
    request_id: str
    conversation: Conversation
    model: str  # the one answering: the conversation's, or its fallback under load
    user_message_id: str | None  # None when regenerating: no new user message
    watch: ReplyWatch
    dropped: int = 0  # older turns left out of the context
    summarized: bool = False  # a summary stood in for turns before them


@dataclass
class _Prompt:
    """Everything decided before the prompt is produced."""

    caller: Principal
    conversation: Conversation
    model: str
    text: str | None
    messages: list[ChatMessage]
    options: ReplyOptions
    max_tokens: int
    request_id: str
    now: int
    admission: Admission
    dropped: int
    summarized: bool


@dataclass
class ChatDeps:
    settings: Settings
    conversations: ConversationService
    fanout: TokenFanout
    producer: AIOKafkaProducer
    submitter: PromptSubmitter
    redis: aioredis.Redis
    quotas: Quotas
    moderator: Moderator
    router: ModelRouter
    streams: StreamSlots
    jobs: ConversationJobs


class ChatService:
    def __init__(self, deps: ChatDeps) -> None:
        self.deps = deps

    async def post(self, caller: Principal, conversation_id: str, body: PostMessage) -> Reply:
        opened = await self.deps.conversations.get(caller.user_id, conversation_id)
        conversation = Conversation(**opened.model_dump(include=set(Conversation.model_fields)))
        text = self.moderated(body.content)
        summary, turns = _after_summary(opened)
        reply = await self.reply(
            caller, conversation, [_chat(m) for m in turns], text, body, summary=summary
        )
        if reply.dropped:  # older turns no longer fit: have them summarized for next time
            self.deps.jobs.summary(caller.user_id, conversation, summary, turns[: reply.dropped])
        return reply

    async def regenerate(
        self, caller: Principal, conversation_id: str, body: ReplyOptions
    ) -> Reply:
        """A fresh reply to the last user message; the replies after it are replaced."""
        conversation = await self.deps.conversations.owned(caller.user_id, conversation_id)
        await self._not_busy(conversation_id)
        visible = await self._visible(caller, conversation_id)
        users = [i for i, m in enumerate(visible) if m.role == "user"]
        if not users:
            raise ApiError(409, "there is no message to reply to yet", kind="conflict_error")
        await self.deps.conversations.mark_replaced(conversation_id, visible[users[-1] + 1 :])
        return await self.reply(caller, conversation, _usable(visible[: users[-1] + 1]), None, body)

    async def edit(
        self, caller: Principal, conversation_id: str, message_id: str, body: PostMessage
    ) -> Reply:
        """Replace a user message and everything after it, then reply to the new text."""
        conversation = await self.deps.conversations.owned(caller.user_id, conversation_id)
        await self._not_busy(conversation_id)
        visible = await self._visible(caller, conversation_id)
        at = next(
            (i for i, m in enumerate(visible) if m.id == message_id and m.role == "user"), None
        )
        if at is None:
            raise not_found("user message")
        text = self.moderated(body.content)
        await self.deps.conversations.mark_replaced(conversation_id, visible[at:])
        return await self.reply(caller, conversation, _usable(visible[:at]), text, body)

    async def reply(
        self,
        caller: Principal,
        conversation: Conversation,
        history: list[ChatMessage],
        new_text: str | None,
        options: ReplyOptions,
        client_context: bool = False,
        summary: str | None = None,
    ) -> Reply:
        """Context, quota, then the prompt: the part every way of asking shares."""
        d = self.deps
        max_tokens = self._max_tokens(caller, options)
        asked = [
            *history,
            *([ChatMessage(role="user", content=new_text)] if new_text is not None else []),
        ]
        context = self._context(asked, max_tokens, client_context, summary)
        request_id, now = f"r_{uuid.uuid4().hex}", now_ms()
        admission = await self._admit(caller, request_id, context.prompt_tokens + max_tokens, now)
        model = d.router.answering(conversation.model, caller.tier)
        try:
            return await self._start(
                _Prompt(
                    caller,
                    conversation,
                    model,
                    new_text,
                    context.messages,
                    options,
                    max_tokens,
                    request_id,
                    now,
                    admission,
                    context.dropped,
                    summary is not None and not client_context,
                )
            )
        except BaseException:
            await d.quotas.settle(admission, 0)
            await d.quotas.release(admission)
            raise

    def _context(
        self,
        asked: list[ChatMessage],
        max_tokens: int,
        client_context: bool,
        summary: str | None = None,
    ) -> Context:
        """The chat page's history is trimmed to fit, oldest first, under the configured
        system prompt. An API client sends the whole context itself, system prompt
        included: if it does not fit, it is refused, never silently cut."""
        settings = self.deps.settings
        system = None if client_context else settings.system_prompt
        if summary and not client_context:
            system = f"{system or ''}\n\nSummary of the earlier conversation: {summary}".strip()
        try:
            context = assemble(system, asked, settings.context_window, max_tokens)
        except ContextTooLong as exc:
            raise ApiError(413, str(exc), param="content") from exc
        if client_context and context.dropped:
            raise ApiError(
                400,
                f"context_length_exceeded: the messages and max_tokens {max_tokens} need more "
                f"than the model's {settings.context_window}-token context; send fewer "
                f"messages or a smaller max_tokens",
                param="messages",
            )
        return context

    def _max_tokens(self, caller: Principal, options: ReplyOptions) -> int:
        limit = self.deps.settings.tiers[caller.tier].max_reply_tokens
        if options.max_tokens is None:
            return min(self.deps.settings.reply_max_tokens, limit)
        if options.max_tokens > limit:
            raise ApiError(
                400,
                f"max_tokens {options.max_tokens} is above tier {caller.tier!r}'s limit of {limit}",
                param="max_tokens",
            )
        return options.max_tokens

    def moderated(self, content: str) -> str:
        verdict = self.deps.moderator.check_input(content)
        if not verdict.allowed:
            raise ApiError(
                400, verdict.reason or "blocked", kind="moderation_error", param="content"
            )
        return verdict.text

    async def _not_busy(self, conversation_id: str) -> None:
        if await self.deps.redis.exists(_inflight_key(conversation_id)):
            raise ApiError(409, "a reply is being generated: stop it first", kind="conflict_error")

    async def _visible(self, caller: Principal, conversation_id: str) -> list[Message]:
        opened = await self.deps.conversations.get(caller.user_id, conversation_id)
        return [m for m in opened.messages if m.status != "replaced"]

    async def stop(self, caller: Principal, conversation_id: str) -> str:
        await self.deps.conversations.owned(caller.user_id, conversation_id)
        inflight = await self.deps.redis.get(_inflight_key(conversation_id))
        if inflight is None:
            raise ApiError(
                409, "no reply is being generated in this conversation", kind="conflict_error"
            )
        request_id = str(orjson.loads(inflight)["request_id"])
        await request_cancel(self.deps.producer, self.deps.redis, request_id, "stop button")
        return request_id

    async def resume_events(
        self, caller: Principal, conversation_id: str
    ) -> AsyncIterator[Delivered]:
        """The current reply's events from its start: the caller skips what was sent."""
        await self.deps.conversations.owned(caller.user_id, conversation_id)
        inflight = await self.deps.redis.get(_inflight_key(conversation_id))
        if inflight is None:
            raise ApiError(
                404, "no reply is being generated in this conversation", kind="not_found_error"
            )
        record = orjson.loads(inflight)
        events = read_request(
            self.deps.settings, record["request_id"], record["partition"], record["offset"]
        )
        return self._clearing_when_final(conversation_id, record["request_id"], events)

    async def _clearing_when_final(
        self, conversation_id: str, request_id: str, events: AsyncIterator[Delivered]
    ) -> AsyncIterator[Delivered]:
        """A resumed reply whose gateway died: nobody else will mark it finished."""
        async for item in events:
            if isinstance(item.event, FinalEvent):  # before the client may close the stream
                key = _inflight_key(conversation_id)
                current = await self.deps.redis.get(key)
                if current is not None and orjson.loads(current)["request_id"] == request_id:
                    await self.deps.redis.delete(key)
            yield item

    async def _admit(self, caller: Principal, request_id: str, tokens: int, now: int) -> Admission:
        policy = self.deps.settings.tiers[caller.tier]
        try:
            return await self.deps.quotas.admit(caller.user_id, policy, request_id, tokens, now)
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
            ) from exc

    async def _start(self, p: _Prompt) -> Reply:
        """Store the user's message (if there is a new one), produce the prompt, follow it."""
        d = self.deps
        user_message_id = f"m_{uuid.uuid4().hex}" if p.text is not None else None
        if p.text is not None and user_message_id is not None:
            await d.conversations.add_user_message(
                p.caller.user_id, p.conversation, user_message_id, p.text, p.now
            )
        sub = await d.fanout.subscribe(p.request_id)
        prompt = PromptRequest(
            request_id=p.request_id,
            model=p.model,
            user_id=p.caller.user_id,
            tier=p.caller.tier,
            band=d.settings.tiers[p.caller.tier].band,
            conversation_id=p.conversation.id,
            messages=p.messages,
            sampling=Sampling(
                max_tokens=p.max_tokens,
                temperature=_temperature(p.options),
                ignore_eos=p.options.ignore_eos,
            ),
            created_at_ms=p.now,
            deadline_ms=p.now + int(d.settings.queue_timeout_s * 1000),
            reply_partition=sub.partition,
            prompt_tokens_estimate=p.admission.estimated_tokens - p.max_tokens,
            # Admitted uncounted (Redis was down): nothing for the usage stream to settle.
            charged_tokens=p.admission.estimated_tokens if p.admission.counted else 0,
        )
        try:
            await asyncio.wait_for(d.submitter.submit(prompt), d.settings.kafka_send_timeout_s)
        except (KafkaError, TimeoutError) as exc:
            d.fanout.unsubscribe(sub)
            await self._withdraw(p.request_id)
            if user_message_id is not None:
                await d.conversations.mark_failed(p.conversation.id, user_message_id, p.now)
            raise ApiError(
                503,
                "the prompt queue is unreachable; your message is saved as failed, please retry",
                kind="service_unavailable",
                headers={"Retry-After": str(QUEUE_RETRY_S)},
            ) from exc
        watch = await self._follow(p, sub)
        return Reply(
            p.request_id, p.conversation, p.model, user_message_id, watch, p.dropped, p.summarized
        )

    async def _withdraw(self, request_id: str) -> None:
        """The client is told its message failed, but the idempotent producer keeps the
        prompt and delivers it once Kafka is back: mark it done, so workers drop it
        instead of answering a message shown as failed."""
        with contextlib.suppress(*REDIS_DOWN):
            await self.deps.redis.set(done_key(request_id), 0, ex=ATTEMPT_TTL_S)

    async def _follow(self, p: _Prompt, sub: Subscription) -> ReplyWatch:
        """Record the reply as in flight; when it ends, settle its quota and, after a
        conversation's first reply, ask for its title."""
        d = self.deps
        conversation_id = p.conversation.id
        inflight = {
            "request_id": sub.request_id,
            "partition": sub.partition,
            "offset": sub.next_offset,
        }
        try:  # Redis down: the reply still streams; stop and resume wait for Redis
            await d.redis.set(
                _inflight_key(conversation_id), orjson.dumps(inflight), ex=INFLIGHT_TTL_S
            )
        except REDIS_DOWN as exc:
            log.warning("%s: not marked in flight, Redis unreachable (%s)", sub.request_id, exc)

        async def finished(final: FinalEvent | None) -> None:
            d.fanout.unsubscribe(sub)
            with contextlib.suppress(*REDIS_DOWN):  # then the mark expires by itself
                await d.redis.delete(_inflight_key(conversation_id))
            used = final.usage.prompt_tokens + final.usage.completion_tokens if final else 0
            await d.quotas.settle(p.admission, used)
            await d.quotas.release(p.admission)
            if final and final.finish_reason in ("stop", "length") and p.text is not None:
                await self._title_once(p, final.text)

        # The worker answers an expired prompt itself; silence past that means no worker.
        return ReplyWatch(sub, d.settings.queue_timeout_s + d.settings.no_worker_grace_s, finished)

    async def _title_once(self, p: _Prompt, answer: str) -> None:
        """Only a title nobody chose: none yet, or the first message's opening words."""
        question = p.text or ""
        if p.conversation.title not in (None, question[:60]):
            return
        key = f"tandoor:titled:{p.conversation.id}"
        if await self.deps.redis.set(key, 1, nx=True, ex=30 * 24 * 3600):
            self.deps.jobs.title(p.caller.user_id, p.conversation, question, answer)


def _usable(messages: list[Message]) -> list[ChatMessage]:
    """Turns that go into the context: the user's, and replies that were shown."""
    return [_chat(m) for m in messages if _shown(m)]


def _chat(message: Message) -> ChatMessage:
    if message.role == "user":
        return ChatMessage(role="user", content=message.content)
    return ChatMessage(role="assistant", content=message.content)


def _after_summary(opened: ConversationWithMessages) -> tuple[str | None, list[Message]]:
    """The summary, if any, and the usable turns it does not cover."""
    until = opened.summary_until
    turns = [
        m
        for m in opened.messages
        if m.status != "replaced" and _shown(m) and (until is None or m.created_at > until)
    ]
    return (opened.summary if until else None), turns


def _shown(message: Message) -> bool:
    if message.role == "user":
        return message.status != "failed"
    return message.status in REPLY_STATUSES and bool(message.content)


def _inflight_key(conversation_id: str) -> str:
    return f"tandoor:inflight:{conversation_id}"


def _temperature(body: ReplyOptions) -> float:
    return 0.7 if body.temperature is None else body.temperature  # 0 is greedy, not unset
