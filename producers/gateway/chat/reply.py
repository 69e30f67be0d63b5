"""What a caller asks for a reply with, beyond a conversation of its own (an OpenAI API
call), and what it gets back: the reply to follow."""

from __future__ import annotations

from dataclasses import dataclass

from producers.gateway.chat.watch import ReplyWatch
from producers.gateway.conversations.protocol import Conversation


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
