"""Which stored turns of a conversation go into the model's context."""

from __future__ import annotations

from producers.gateway.conversations.protocol import ConversationWithMessages, Message
from schemas.events import ChatMessage

REPLY_STATUSES = {"complete", "stopped"}


def usable(messages: list[Message]) -> list[ChatMessage]:
    """Turns that go into the context: the user's, and replies that were shown."""
    return [as_chat(m) for m in messages if shown(m)]


def as_chat(message: Message) -> ChatMessage:
    if message.role == "user":
        return ChatMessage(role="user", content=message.content)
    return ChatMessage(role="assistant", content=message.content)


def after_summary(opened: ConversationWithMessages) -> tuple[str | None, list[Message]]:
    """The summary, if any, and the usable turns it does not cover. A summary of turns
    an edit replaced is not used: what the user edited away stays out of the context."""
    until = None if opened.summary_stale else opened.summary_until
    turns = [
        m
        for m in opened.messages
        if m.status != "replaced" and shown(m) and (until is None or m.created_at > until)
    ]
    return (opened.summary if until else None), turns


def left_out_for_good(
    turns: list[Message], dropped: int, answering: str, conversation_model: str
) -> list[Message]:
    """The oldest `dropped` turns, which no longer fit the context: summarized for next
    time. None when a fallback answered under load: cut to its window (maybe smaller),
    they were summarized for good, and left out of the conversation's own model too."""
    return turns[:dropped] if answering == conversation_model else []


def visible(opened: ConversationWithMessages) -> list[Message]:
    """What the conversation shows: everything but replaced turns."""
    return [m for m in opened.messages if m.status != "replaced"]


def shown(message: Message) -> bool:
    if message.role == "user":
        return message.status != "failed"
    return message.status in REPLY_STATUSES and bool(message.content)
