"""What a caller asks for a reply with, beyond a conversation of its own (an OpenAI API
call), the prompt planned for it, and what it gets back: the reply to follow."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from producers.gateway.chat.protocol import ReplyOptions
from producers.gateway.chat.watch import ReplyWatch
from producers.gateway.conversations.protocol import Conversation
from producers.gateway.conversations.rows import from_ms
from schemas.events import ChatMessage, MessageKey
from tandoor.policies.api_keys import Principal


@dataclass
class Reply:
    request_id: str
    conversation: Conversation
    model: str  # the one answering: the conversation's, or its fallback under load
    user_message_id: str | None  # None when regenerating: no new user message
    watch: ReplyWatch
    dropped: int = 0  # older turns left out of the context
    summarized: bool = False  # a summary stood in for turns before them


@dataclass(frozen=True)
class ApiCall:
    """An OpenAI API call: the client sends the whole context; its conversation is opened
    only once the call is admitted (a refused call leaves none behind), and not kept at
    all with `store: false`; it asks for no title or summary, which nobody would read."""

    model: str
    title: str | None
    store: bool = True
    # Picks its prompt's partition in place of its conversation, new on every call: the
    # turns of one chat go to one worker, whose prefix cache holds their history.
    affinity: str | None = None


@dataclass
class PlannedPrompt:
    """Everything decided before the prompt is produced."""

    caller: Principal
    conversation: Conversation | ApiCall  # an ApiCall's is opened when it is produced
    model: str
    text: str | None
    messages: list[ChatMessage]
    options: ReplyOptions
    max_tokens: int
    request_id: str
    now: int
    tokens: int  # charged: the prompt's estimate and max_tokens
    dropped: int
    summarized: bool
    replaces: list[MessageKey]  # hidden once the reply is queued
    # The conversation's title (its first message's) goes with the message, written as
    # of this time (ms: when it was read untitled), or None.
    names_it: int | None

    @property
    def affinity(self) -> str | None:
        """What picks the prompt's partition in place of its conversation (an API call's)."""
        return self.conversation.affinity if isinstance(self.conversation, ApiCall) else None

    def opened(self) -> Conversation:
        """The conversation to answer in: an API call's is made here, and stored with its
        message (unless told not to be: then it exists only in the prompt's id)."""
        if not isinstance(self.conversation, ApiCall):
            return self.conversation
        at = from_ms(self.now)  # as the message's row is keyed (mark_failed finds it)
        return Conversation(
            id=f"c_{uuid.uuid4().hex}",
            model=self.conversation.model,
            title=self.conversation.title,
            created_at=at,
            updated_at=at,
        )
