"""A short title for each new conversation, written by the model as a background job.

When a conversation's first reply is done, a `title` prompt goes through the same
pipeline in the lowest band (never ahead of anyone's chat). The replica that asked
follows it like a reply and stores the title, unless the user renamed the chat
meanwhile. Asked once per conversation; if the replica dies first, the chat keeps
the title it had.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from consumers.fanout import TokenFanout
from producers.gateway.conversations.protocol import Conversation
from producers.gateway.conversations.service import ConversationService
from producers.prompts import PromptSubmitter
from schemas.events import ChatMessage, FinalEvent, PromptRequest, Sampling, now_ms
from tandoor.settings import Settings

log = logging.getLogger(__name__)

JOB_BAND = "batch"
TITLE_MAX_CHARS = 60
TITLE_WAIT_S = 600.0  # the batch band may be busy; nothing waits on this
INSTRUCTION = (
    "Write a title of at most six words for this conversation. "
    "Reply with the title only, no quotes."
)


def title_prompt(
    conversation: Conversation, user_id: str, question: str, answer: str, reply_partition: int
) -> PromptRequest:
    exchange = f"User: {question[:1500]}\nAssistant: {answer[:1500]}"
    return PromptRequest(
        request_id=f"title_{conversation.id}",
        model=conversation.model,
        user_id=user_id,
        tier="batch",
        band=JOB_BAND,
        conversation_id=conversation.id,
        messages=[
            ChatMessage(role="system", content=INSTRUCTION),
            ChatMessage(role="user", content=exchange),
        ],
        sampling=Sampling(max_tokens=16, temperature=0.0),
        created_at_ms=now_ms(),
        reply_partition=reply_partition,
        kind="title",
    )


def clean_title(text: str) -> str | None:
    """The model's first line, without quotes or a 'Title:' label, cut to fit."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    if line.lower().startswith("title:"):
        line = line[6:].strip()
    line = line.strip("\"'*#` ").rstrip(".")
    return line[:TITLE_MAX_CHARS].strip() or None


class TitleJobs:
    def __init__(
        self,
        settings: Settings,
        fanout: TokenFanout,
        submitter: PromptSubmitter,
        conversations: ConversationService,
    ) -> None:
        self.settings = settings
        self.fanout = fanout
        self.submitter = submitter
        self.conversations = conversations
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, user_id: str, conversation: Conversation, question: str, answer: str) -> None:
        task = asyncio.create_task(self._title(user_id, conversation, question, answer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _title(
        self, user_id: str, conversation: Conversation, question: str, answer: str
    ) -> None:
        request_id = f"title_{conversation.id}"
        sub = await self.fanout.subscribe(request_id)
        try:
            prompt = title_prompt(conversation, user_id, question, answer, sub.partition)
            await self.submitter.submit(prompt)
            async with asyncio.timeout(TITLE_WAIT_S):
                while not isinstance((item := await sub.queue.get()).event, FinalEvent):
                    pass
            final = item.event
            title = clean_title(final.text) if final.finish_reason in ("stop", "length") else None
            current = await self.conversations.owned(user_id, conversation.id)
            if title and current.title == conversation.title:  # the user has not renamed it
                await self.conversations.rename(user_id, conversation.id, title)
        except Exception as exc:  # a title is a nicety: never let it disturb anything
            with contextlib.suppress(Exception):
                log.warning("no title for %s: %r", conversation.id, exc)
        finally:
            self.fanout.unsubscribe(sub)
