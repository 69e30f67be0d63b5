"""Asking for a reply (post, regenerate, edit, and the OpenAI API through `reply`): the
checks, the user message stored, the prompt produced and the reply followed. What a
reply must pass lives in checks.py, the in-flight record in inflight.py, stopping and
resuming in control.py, titles and summaries in jobs.py, the conversation a turn is
added to in settled.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis
from aiokafka.errors import KafkaError

from consumers.fanout import NotRouting, Subscription, TokenFanout
from producers.gateway.chat.checks import ReplyChecks
from producers.gateway.chat.control import ReplyControl
from producers.gateway.chat.history import (
    after_summary,
    as_chat,
    left_out_for_good,
    usable,
    visible,
)
from producers.gateway.chat.inflight import InFlight, Queued
from producers.gateway.chat.jobs import ConversationJobs
from producers.gateway.chat.newest import Newest, NewestReply
from producers.gateway.chat.protocol import PostMessage, Regenerate, ReplyOptions, sampling_for
from producers.gateway.chat.reply import ApiCall, PlannedPrompt, Reply
from producers.gateway.chat.routing import Request, route
from producers.gateway.chat.settled import SettledHistory, reply_stored
from producers.gateway.chat.watch import ReplyWatch
from producers.gateway.conversations.protocol import Conversation, Message, provisional_title
from producers.gateway.conversations.rows import message_key
from producers.gateway.conversations.service import ConversationService
from producers.gateway.errors import ApiError, kafka_unreachable, not_found, tagged_refusal
from producers.gateway.shedding import ModelRouter
from producers.gateway.streaming import StreamSlots
from producers.prompts import PromptSubmitter, PromptTooLarge
from schemas.events import ANSWERED, ChatMessage, FinalEvent, MessageKey, PromptRequest, now_ms
from tandoor.clients import CASSANDRA_DOWN, REDIS_DOWN
from tandoor.policies.api_keys import Principal
from tandoor.policies.moderation import OutputFilter
from tandoor.policies.quota import Admission, Quotas
from tandoor.policies.redis_keys import ATTEMPT_TTL_S, done_key
from tandoor.renewing_producer import RenewingProducer
from tandoor.settings import Settings

log = logging.getLogger(__name__)


@dataclass
class ChatDeps:
    settings: Settings
    conversations: ConversationService
    fanout: TokenFanout
    producer: RenewingProducer
    submitter: PromptSubmitter
    redis: aioredis.Redis
    quotas: Quotas
    checks: ReplyChecks
    router: ModelRouter
    streams: StreamSlots
    jobs: ConversationJobs


class ChatService:
    def __init__(self, deps: ChatDeps) -> None:
        self.deps = deps
        self.inflight = InFlight(deps.redis, stored=reply_stored(deps.conversations))
        self.newest = NewestReply(deps.redis)
        self.history = SettledHistory(deps.conversations, self.newest)
        self.running = ReplyControl(
            deps.settings, deps.conversations, deps.producer, self.inflight, deps.quotas
        )

    async def moderated(self, content: str, param: str = "content") -> str:
        return await self.deps.checks.moderated(content, param)

    @property
    def output_filter(self) -> Callable[[], OutputFilter]:
        return self.deps.checks.moderator.output_filter

    async def post(self, caller: Principal, conversation_id: str, body: PostMessage) -> Reply:
        await self.deps.conversations.owned(caller.user_id, conversation_id)
        with contextlib.suppress(*REDIS_DOWN):  # then posting goes on, as the claim lets it
            await self.inflight.ensure_idle(conversation_id)
        text = await self.moderated(body.content)  # a refusal needs no history: before the wait
        read_at = now_ms()  # a rename after this read keeps its title over the message's
        opened, _ = await self.history.read(caller, conversation_id)  # unstored: left out
        conversation = Conversation(**opened.model_dump(include=set(Conversation.model_fields)))
        title = provisional_title(text)
        untitled = conversation.title is None and not opened.messages and title is not None
        names_it = read_at if untitled else None
        if untitled:  # stored with the message: a refusal before leaves it untitled
            # By its first message as redacted: the page sent it raw as the title,
            # addresses and numbers included, and the title job never ran (no match).
            conversation = conversation.model_copy(update={"title": title})
        summary, turns = after_summary(opened)
        reply = await self.reply(
            caller,
            conversation,
            [as_chat(m) for m in turns],
            text,
            body,
            summary=summary,
            names_it=names_it,
        )
        dropped = left_out_for_good(turns, reply.dropped, reply.model, conversation.model)
        if dropped:
            stale = opened.summary_stale
            self.deps.jobs.after_context_cut(caller.user_id, conversation, summary, dropped, stale)
        return reply

    async def regenerate(self, caller: Principal, conversation_id: str, body: Regenerate) -> Reply:
        """A fresh reply to the last user message; the replies after it are replaced."""
        conversation = await self.deps.conversations.owned(caller.user_id, conversation_id)
        await self.inflight.ensure_idle(conversation_id)
        shown, unstored = await self.history.visible(caller, conversation_id)
        # The last message sent: one that failed (Kafka refused it) is replaced, not answered.
        sent = [i for i, m in enumerate(shown) if m.role == "user" and m.status != "failed"]
        if not sent:
            raise ApiError(409, "there is no message to reply to yet", kind="conflict_error")
        cut = shown[sent[-1]]
        if body.reply_to is not None and body.reply_to != cut.id:
            # A tab behind: it showed one reply, and the newest question was another's.
            raise ApiError(
                409,
                "the conversation has a newer message than the one shown: reopen it",
                kind="conflict_error",
                param="reply_to",
            )
        replaces = [*shown[sent[-1] + 1 :], *_after(unstored, cut)]
        return await self.reply(
            caller, conversation, usable(shown[: sent[-1] + 1]), None, body, replaces=replaces
        )

    async def edit(
        self, caller: Principal, conversation_id: str, message_id: str, body: PostMessage
    ) -> Reply:
        """Replace a user message and everything after it, then reply to the new text."""
        conversation = await self.deps.conversations.owned(caller.user_id, conversation_id)
        await self.inflight.ensure_idle(conversation_id)
        text = await self.moderated(body.content)
        opened, unstored = await self.history.read(caller, conversation_id)
        shown = visible(opened)
        at = next((i for i, m in enumerate(shown) if m.id == message_id and m.role == "user"), None)
        if at is None:
            raise not_found("user message")
        replaces = [*shown[at:], *_after([unstored] if unstored else [], shown[at])]
        history = usable(shown[:at])
        reply = await self.reply(caller, conversation, history, text, body, replaces=replaces)
        until = opened.summary_until
        if until is not None and shown[at].created_at <= until:  # what it edited away
            # Once queued: a refused edit leaves the conversation as it was. Should this
            # fail, the turns marked replaced keep the summary unused (summary_stale).
            try:
                await self.deps.conversations.forget_summary(conversation_id)
            except CASSANDRA_DOWN as exc:
                log.warning("summary of %s not forgotten: %r", conversation_id, exc)
        return reply

    async def reply(
        self,
        caller: Principal,
        conversation: Conversation | ApiCall,
        history: list[ChatMessage],
        new_text: str | None,
        options: ReplyOptions,
        summary: str | None = None,
        replaces: Sequence[Message] = (),
        names_it: int | None = None,
    ) -> Reply:
        """Context, quota, then the prompt: the part every way of asking shares. What
        `replaces` names (a regenerate's old replies, an edit's old turns) is hidden only
        once this reply is queued: a refusal (busy, too long, over quota, another reply
        running, Kafka down) leaves the conversation as it was."""
        d = self.deps
        client_context = isinstance(conversation, ApiCall)
        max_tokens = d.checks.max_tokens(caller, options, conversation.model)
        asked = [
            *history,
            *([ChatMessage(role="user", content=new_text)] if new_text is not None else []),
        ]
        length = options.length_param
        request = Request(
            caller.tier, conversation.model, asked, max_tokens, length, client_context, summary
        )
        model, context = await route(d.router, d.checks, request)
        return await self._start(
            PlannedPrompt(
                caller,
                conversation,
                model,
                new_text,
                context.messages,
                options,
                max_tokens,
                f"r_{uuid.uuid4().hex}",
                now_ms(),
                context.prompt_tokens + max_tokens,
                context.dropped,
                context.summarized,
                [message_key(m) for m in replaces],
                names_it,
            )
        )

    async def _start(self, p: PlannedPrompt) -> Reply:
        """Claim the conversation, charge the quota, store the user's message (if there
        is a new one), produce the prompt, follow it. The claim comes first: a second
        post racing this one is a 409 before it is charged anything."""
        d = self.deps
        store = not isinstance(p.conversation, ApiCall) or p.conversation.store
        conversation = p.opened()  # p's stays an ApiCall
        try:
            sub = await d.fanout.subscribe(p.request_id)
        except NotRouting as exc:
            raise kafka_unreachable(f"{exc}; nothing was changed, please retry") from exc
        start_by = p.now + int(d.settings.silence_limit_s(p.caller.tier) * 1000)
        user_message_id = f"m_{uuid.uuid4().hex}" if p.text is not None and store else None
        queued = Queued(p.model, p.now, p.replaces, store, user_message_id, p.caller.tier)
        if not await self.inflight.claim(conversation.id, sub, start_by, queued):  # one at a time
            d.fanout.unsubscribe(sub)
            raise ApiError(409, "a reply is being generated: stop it first", kind="conflict_error")
        admission: Admission | None = None
        try:
            if p.text is None and not isinstance(p.conversation, ApiCall):
                await self._not_deleted_since_read(p.caller.user_id, conversation.id)
            admission = await d.checks.admit(p.caller, p.request_id, p.tokens, p.now)
            if p.text is not None and user_message_id is not None:
                await self._store_user_message(p, conversation, user_message_id, p.text)
            await self._produce(p, admission, conversation, sub, store, user_message_id)
        except BaseException as exc:
            d.fanout.unsubscribe(sub)
            try:
                if admission is not None:  # refused after all: it counts against no limit
                    await d.quotas.refund(admission)
            finally:
                await self.inflight.release(conversation.id, p.request_id)
            refusal = tagged_refusal(exc, p.request_id)
            if refusal is exc:
                raise
            raise refusal from exc
        await self.inflight.mark_queued(conversation.id, p.request_id)
        if store:  # the next turn waits for this reply to be stored (newest.py)
            await self.newest.note(conversation.id, Newest(p.request_id, p.now))
        await self._hide_replaced(conversation.id, p.replaces)
        watch = self._follow(p, admission, conversation, sub)
        return Reply(
            p.request_id, conversation, p.model, user_message_id, watch, p.dropped, p.summarized
        )

    async def _not_deleted_since_read(self, user_id: str, conversation_id: str) -> None:
        """A regenerate writes no message to find a delete made since its read: read again
        once claimed (a later delete finds the claim and stops the reply)."""
        with contextlib.suppress(*CASSANDRA_DOWN):  # the reads just made: left as read
            await self.deps.conversations.owned(user_id, conversation_id)

    async def _produce(
        self,
        p: PlannedPrompt,
        admission: Admission,
        conversation: Conversation,
        sub: Subscription,
        store: bool,
        user_message_id: str | None,
    ) -> None:
        """Hand the prompt to Kafka; if Kafka does not take it, the message is failed."""
        d = self.deps
        prompt = PromptRequest(
            request_id=p.request_id,
            model=p.model,
            user_id=p.caller.user_id,
            tier=p.caller.tier,
            band=d.settings.tiers[p.caller.tier].band,
            conversation_id=conversation.id,
            messages=p.messages,
            sampling=sampling_for(p.options, p.max_tokens),
            created_at_ms=p.now,
            deadline_ms=p.now + int(d.settings.wait_budget_s(p.caller.tier) * 1000),
            reply_partition=sub.partition,
            prompt_tokens_estimate=admission.estimated_tokens - p.max_tokens,
            # Admitted uncounted (Redis was down): nothing for the usage stream to settle.
            charged_tokens=admission.estimated_tokens if admission.counted else 0,
            store=store,
            replaces=p.replaces,
        )
        try:
            submitted = d.submitter.submit(prompt, p.affinity)
            await asyncio.wait_for(submitted, d.settings.kafka_send_timeout_s)
        except PromptTooLarge as exc:
            said = await self._unqueued_said(p, conversation, user_message_id)
            raise ApiError(
                413, f"{exc}; {said}; shorten the conversation", param="messages"
            ) from exc
        except (KafkaError, TimeoutError) as exc:
            await self._withdraw(p.request_id)
            said = await self._unqueued_said(p, conversation, user_message_id)
            raise kafka_unreachable(
                f"the prompt queue is unreachable; {said}, please retry"
            ) from exc

    async def _unqueued_said(
        self, p: PlannedPrompt, conversation: Conversation, user_message_id: str | None
    ) -> str:
        """_unqueued, and what became of the message, in words for the client."""
        try:
            kept = await self._unqueued(p, conversation, user_message_id)
        except CASSANDRA_DOWN:  # stored as sent: sending it again would send it twice
            return (
                "storage is unreachable too: the message may be saved without a reply (regenerate)"
            )
        return "your message is saved as failed" if kept else "nothing was kept"

    async def _unqueued(
        self, p: PlannedPrompt, conversation: Conversation, user_message_id: str | None
    ) -> bool:
        """The stored message of a prompt Kafka did not take: kept as failed in a chat (to
        retry); gone with its conversation for an API call, opened for it alone (each SDK
        retry left one more behind, titled with the prompt). True if kept."""
        if user_message_id is None:
            return False
        conversations = self.deps.conversations
        if isinstance(p.conversation, ApiCall):
            await conversations.delete(p.caller.user_id, conversation.id)
            return False
        await conversations.mark_failed(conversation.id, user_message_id, p.now)
        return True

    async def _hide_replaced(self, conversation_id: str, replaced: list[MessageKey]) -> None:
        """Once the new reply is queued (a refusal before leaves the chat as it was).
        Cassandra failing now leaves them shown until persistence marks them."""
        if not replaced:
            return
        try:
            await self.deps.conversations.mark_replaced(conversation_id, replaced)
        except CASSANDRA_DOWN as exc:
            log.warning("%s: superseded messages still shown (%s)", conversation_id, exc)

    async def _store_user_message(
        self, p: PlannedPrompt, conversation: Conversation, message_id: str, text: str
    ) -> None:
        conversations, user_id = self.deps.conversations, p.caller.user_id
        if isinstance(p.conversation, ApiCall):  # its conversation is new: stored with it
            await conversations.create_with_message(user_id, conversation, message_id, text)
        else:
            await conversations.add_user_message(
                user_id, conversation, message_id, text, p.now, p.names_it
            )

    async def _withdraw(self, request_id: str) -> None:
        """The client is told its message failed, but the idempotent producer delivers it
        once Kafka is back: marked done, workers drop it instead of answering a message
        shown as failed; one that took it already is told to stop."""
        with contextlib.suppress(*REDIS_DOWN):
            await self.deps.redis.set(done_key(request_id), 0, ex=ATTEMPT_TTL_S)
        self.running.stop_withdrawn(request_id)

    def _follow(
        self, p: PlannedPrompt, admission: Admission, conversation: Conversation, sub: Subscription
    ) -> ReplyWatch:
        """When the reply ends: its in-flight record goes, its quota is settled, and the
        conversation's jobs hear of it (a title after its first reply)."""
        d = self.deps
        asks_jobs = not isinstance(p.conversation, ApiCall)

        async def finished(final: FinalEvent | None) -> None:
            d.fanout.unsubscribe(sub)
            if final is None:  # silent past the tier's limit: see stop_given_up
                await self.running.stop_given_up(p.request_id)
            await self.inflight.release(conversation.id, p.request_id)
            if final is not None:
                await d.quotas.settle(admission, final.usage.total_tokens)
            await d.quotas.release(admission)
            if final and final.finish_reason in ANSWERED and asks_jobs:
                await d.jobs.after_reply(p.caller.user_id, conversation, p.text, final.text)

        # The worker answers an expired prompt itself; silence past that means no worker.
        return ReplyWatch(sub, d.settings.silence_limit_s(p.caller.tier), finished)


def _after(unstored: list[Message], cut: Message) -> list[Message]:
    """The unstored reply, if it comes after `cut` (not one a later turn followed)."""
    return [m for m in unstored if m.created_at > cut.created_at]
