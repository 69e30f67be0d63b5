"""Background jobs for conversations, run by the model through the same pipeline in
the lowest band (never ahead of anyone's chat), and followed by the replica that
asked, like a reply:

- a short title once a conversation's first reply is done (unless the user chose
  one, or renames it meanwhile);
- a summary of the older turns once they no longer fit the model's context, which
  context assembly then uses in their place.

If the replica dies first the job's result is simply not stored: a title stays as it
was, and the next reply that cannot fit its history asks for the summary again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from aiokafka.errors import KafkaError

from consumers.fanout import TokenFanout
from producers.gateway.chat.checks import ReplyChecks
from producers.gateway.conversations.protocol import (
    AUTO_TITLE_CHARS,
    Conversation,
    Message,
    provisional_title,
)
from producers.gateway.conversations.service import (
    SUMMARY_WRITTEN_WITHIN_S,
    ConversationService,
)
from producers.prompts import PromptSubmitter
from schemas.events import (
    ANSWERED,
    ChatMessage,
    FinalEvent,
    PromptKind,
    PromptRequest,
    Sampling,
    now_ms,
)
from tandoor.background import Background
from tandoor.clients import REDIS_DOWN
from tandoor.policies.redis_keys import TITLED_TTL_S, titled_key
from tandoor.settings import BATCH_BAND

log = logging.getLogger(__name__)

JOB_WAIT_S = 600.0  # the batch band may be busy; nobody waits on a job
SUMMARY_WRITE_MARGIN_S = 60.0  # the post's steps before the job, and the write itself
TITLE_INSTRUCTION = (
    "Write a title of at most six words for this conversation. "
    "Reply with the title only, no quotes."
)
SUMMARY_INSTRUCTION = (
    "Summarize this conversation in at most five sentences, keeping names, facts and "
    "decisions the user may refer to later."
)
TITLE_TOKENS = 16
SUMMARY_TOKENS = 160
EXCERPT_CHARS = 1500  # of each message, in a job's prompt
SHORTEST_EXCERPT = 90  # shortened to fit the model's window (halved from EXCERPT_CHARS)


def clean_title(text: str) -> str | None:
    """The model's first line, without quotes or a 'Title:' label, cut to fit."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    if line.lower().startswith("title:"):
        line = line[6:].strip()
    line = line.strip("\"'*#` ").rstrip(".")
    return line[:AUTO_TITLE_CHARS].strip() or None


def transcript(
    turns: list[tuple[str, str]],
    previous_summary: str | None = None,
    fits: Callable[[str], bool] = lambda _: True,
) -> str:
    """The turns as a job is shown them, made to fit the model's window: each excerpt
    shortened, then the oldest turns left out. Unfitted, twelve turns made a summary
    prompt the worker refused, and each later job covered more: none ever ran again."""
    excerpt = EXCERPT_CHARS
    while excerpt > SHORTEST_EXCERPT and not fits(_lines(turns, previous_summary, excerpt)):
        excerpt = max(SHORTEST_EXCERPT, excerpt // 2)
    text = _lines(turns, previous_summary, excerpt)
    if fits(text) or len(turns) < 2:
        return text
    low, high = 1, len(turns) - 1  # the fewest oldest turns to leave out: the newest one stays
    while low < high:
        middle = (low + high) // 2
        if fits(_lines(turns[middle:], previous_summary, excerpt)):
            high = middle
        else:
            low = middle + 1
    return _lines(turns[low:], previous_summary, excerpt)


def _lines(turns: list[tuple[str, str]], previous_summary: str | None, excerpt: int) -> str:
    lines = [f"Earlier: {previous_summary}"] if previous_summary else []
    lines += [f"{role.capitalize()}: {text[:excerpt]}" for role, text in turns]
    return "\n".join(lines)


@dataclass(frozen=True)
class PromptJob:
    kind: PromptKind
    request_id: str  # one per job: asking twice never runs it twice
    instruction: str
    content: str
    max_tokens: int


class ConversationJobs:
    def __init__(
        self,
        fanout: TokenFanout,
        submitter: PromptSubmitter,
        conversations: ConversationService,
        redis: aioredis.Redis,
        checks: ReplyChecks,
    ) -> None:
        self.fanout = fanout
        self.submitter = submitter
        self.conversations = conversations
        self.redis = redis
        self.checks = checks
        self.moderator = checks.moderator
        self._tasks = Background()
        self._summarizing: set[str] = set()  # conversation ids
        self._clock = time.monotonic

    async def after_reply(
        self, user_id: str, conversation: Conversation, question: str | None, answer: str
    ) -> None:
        """A reply (to `question`; None: a regenerate) ran to its end: a conversation
        without a chosen title (none yet, or its first message's opening words) gets one
        from the model, once. Not only after the first reply: one stopped or failed
        left the chat named by its opening words for good. Looked into in the background:
        Redis or Cassandra failing here is the job's, not the settled reply's."""
        self._spawn(self._title_if_due(user_id, conversation, question, answer))

    async def _title_if_due(
        self, user_id: str, conversation: Conversation, question: str | None, answer: str
    ) -> None:
        questions = [question]
        looks = conversation.title is not None and conversation.title != provisional_title(
            question or ""
        )  # a later reply's, a regenerate's, or a chosen title: asked once to look
        if not await self._claim_title(conversation):
            return
        try:
            if looks:
                first, live = await self.conversations.first_questions(conversation.id)
                if first is None or conversation.title != provisional_title(first):
                    return
                # Its first message as it stands: an edit took the one that named it out.
                questions = [live, question]
            answered = await self._title(user_id, conversation, questions, answer)
        except BaseException:
            await self._unclaim_title(conversation)
            raise
        if not answered:  # a later reply asks again
            await self._unclaim_title(conversation)

    async def _claim_title(self, conversation: Conversation) -> bool:
        """Whether this reply is the one to look for a title (once per conversation)."""
        claimed = await self.redis.set(titled_key(conversation.id), 1, nx=True, ex=TITLED_TTL_S)
        return bool(claimed)

    async def _unclaim_title(self, conversation: Conversation) -> None:
        with contextlib.suppress(*REDIS_DOWN):
            await self.redis.delete(titled_key(conversation.id))

    def after_context_cut(
        self,
        user_id: str,
        conversation: Conversation,
        previous: str | None,
        turns: list[Message],
        over_stale: bool = False,
    ) -> None:
        """Older `turns` no longer fit the context: summarize them (and the summary of what
        came before them) for the next reply; `over_stale`: in place of a stored summary
        that covers turns an edit replaced. One at a time per conversation: each post
        while one ran asked again, each covering more, piling prompts onto a busy band."""
        if conversation.id in self._summarizing:
            return
        self._summarizing.add(conversation.id)

        async def summarized() -> None:
            try:
                await self._summary(user_id, conversation, previous, turns, over_stale)
            finally:
                self._summarizing.discard(conversation.id)

        self._spawn(summarized())

    async def stop(self) -> None:
        await self._tasks.cancel()

    def _spawn(self, job: Coroutine[Any, Any, None]) -> None:
        async def guarded() -> None:
            try:
                await job
            except Exception as exc:  # a job is a nicety: never let it disturb a chat
                log.warning("conversation job failed: %r", exc)

        self._tasks.start(guarded())

    async def _title(
        self, user_id: str, conversation: Conversation, questions: list[str | None], answer: str
    ) -> bool:
        """Whether the model answered (a title it gave, or none it could)."""
        asked = list(dict.fromkeys(q for q in questions if q))  # the first and this reply's
        turns = [*(("user", q) for q in asked), ("assistant", answer)]
        fits = self._fits(conversation.model, TITLE_INSTRUCTION, TITLE_TOKENS)
        exchange = await asyncio.to_thread(transcript, turns, None, fits)
        # An id per try: a try that got no answer is done for the workers (its done mark).
        request_id = f"title_{conversation.id}_{uuid.uuid4().hex[:12]}"
        job = PromptJob("title", request_id, TITLE_INSTRUCTION, exchange, TITLE_TOKENS)
        text = await self._ask(job, conversation, user_id)
        if text is None:
            return False
        title = clean_title(text)
        read_at = now_ms()  # a rename after this read is kept
        current = await self.conversations.owned(user_id, conversation.id)
        if title and current.title == conversation.title:  # the user has not renamed it
            await self.conversations.rename(user_id, conversation.id, title, as_of_ms=read_at)
        return True

    async def _summary(
        self,
        user_id: str,
        conversation: Conversation,
        previous: str | None,
        turns: list[Message],
        over_stale: bool,
    ) -> None:
        read_at = self._clock()  # the turns were read just before this job started
        until = turns[-1].created_at
        fits = self._fits(conversation.model, SUMMARY_INSTRUCTION, SUMMARY_TOKENS)
        lines = [(m.role, m.content) for m in turns]
        job = PromptJob(
            "summary",
            # An id per try: a try that expired unrun is done for the workers, and the
            # next post with the same cut waited JOB_WAIT_S on it for nothing.
            f"summary_{conversation.id}_{int(until.timestamp() * 1000)}_{uuid.uuid4().hex[:12]}",
            SUMMARY_INSTRUCTION,
            await asyncio.to_thread(transcript, lines, previous, fits),
            SUMMARY_TOKENS,
        )
        text = await self._ask(job, conversation, user_id)
        if not text or not text.strip():
            return
        now = await self.conversations.get(user_id, conversation.id)
        summarized = {m.id for m in turns}
        if any(m.status == "replaced" and m.id in summarized for m in now.messages):
            return  # an edit took those turns out while the job ran
        if self._clock() - read_at > SUMMARY_WRITTEN_WITHIN_S - SUMMARY_WRITE_MARGIN_S:
            # Written later, an edit made between its read and its write would not be
            # told from one made before its read (conversations/service.py).
            log.warning("summary of %s took too long: not kept", conversation.id)
            return
        await self.conversations.set_summary(conversation.id, text.strip(), until, over_stale)

    def _fits(self, model: str, instruction: str, max_tokens: int) -> Callable[[str], bool]:
        return lambda content: self.checks.fits(model, instruction, content, max_tokens)

    async def _ask(self, job: PromptJob, conversation: Conversation, user_id: str) -> str | None:
        """The model's answer to a job, or None (it failed, or took too long)."""
        kind, request_id = job.kind, job.request_id
        sub = await self.fanout.subscribe(request_id)
        try:
            await self.submitter.submit(
                PromptRequest(
                    request_id=request_id,
                    model=conversation.model,
                    user_id=user_id,
                    tier="batch",
                    band=BATCH_BAND,
                    conversation_id=conversation.id,
                    messages=[
                        ChatMessage(role="system", content=job.instruction),
                        ChatMessage(role="user", content=job.content),
                    ],
                    sampling=Sampling(max_tokens=job.max_tokens, temperature=0.0),
                    created_at_ms=now_ms(),
                    # Not begun by then, nobody waits for it: workers drop it unrun.
                    deadline_ms=now_ms() + int(JOB_WAIT_S * 1000),
                    reply_partition=sub.partition,
                    kind=kind,
                )
            )
            async with asyncio.timeout(JOB_WAIT_S):
                while not isinstance((item := await sub.queue.get()).event, FinalEvent):
                    pass
            final = item.event
            # A title or summary is shown and reused like a reply: moderated like one.
            return (
                self.moderator.check_output(final.text) if final.finish_reason in ANSWERED else None
            )
        except (TimeoutError, KafkaError) as exc:
            log.warning("%s job %s: no answer (%r)", kind, request_id, exc)
            return None
        finally:
            self.fanout.unsubscribe(sub)
