"""The conversation a new turn (post, regenerate, edit) is added to: read once its newest
reply is stored (newest.py), and refused when full."""

from __future__ import annotations

import functools
from collections.abc import Awaitable

from producers.gateway.chat.history import visible
from producers.gateway.chat.inflight import StoredReply
from producers.gateway.chat.newest import Newest, NewestReply
from producers.gateway.conversations.protocol import ConversationWithMessages, Message
from producers.gateway.conversations.service import ConversationService
from producers.gateway.errors import ApiError
from schemas.events import MAX_CONVERSATION_MESSAGES
from tandoor.policies.api_keys import Principal

MAX_MESSAGES = MAX_CONVERSATION_MESSAGES  # a turn adds two


class SettledHistory:
    def __init__(self, conversations: ConversationService, newest: NewestReply) -> None:
        self._conversations = conversations
        self._newest = newest

    async def visible(
        self, caller: Principal, conversation_id: str
    ) -> tuple[list[Message], list[Message]]:
        """What the conversation shows once its newest reply is stored; that reply's
        stand-in in the second list if it was not stored within the wait."""
        opened, unstored = await self.read(caller, conversation_id)
        return visible(opened), [unstored] if unstored is not None else []

    async def read(
        self, caller: Principal, conversation_id: str
    ) -> tuple[ConversationWithMessages, Message | None]:
        """The conversation to add a turn to, once its newest reply is stored; a full one
        is refused: every turn (and every read) takes all its messages, replaced ones
        too, so one grown without end slowed the replica's loop for everyone on it."""
        opened, unstored = await self._as_read(caller, conversation_id)
        if len(opened.messages) >= MAX_MESSAGES:
            raise ApiError(
                409,
                f"this conversation holds {len(opened.messages)} messages, the most one may "
                "hold: start a new conversation",
                kind="conflict_error",
            )
        return opened, unstored

    async def _as_read(
        self, caller: Principal, conversation_id: str
    ) -> tuple[ConversationWithMessages, Message | None]:
        conversations = self._conversations

        def read() -> Awaitable[ConversationWithMessages]:
            return conversations.get(caller.user_id, conversation_id)

        stored = functools.partial(reply_stored(conversations), conversation_id)
        return await self._newest.settled(conversation_id, read, stored)


def reply_stored(conversations: ConversationService) -> StoredReply:
    """Whether a conversation's reply is stored, probed by its one row's key."""

    def stored(conversation_id: str, newest: Newest) -> Awaitable[bool]:
        return conversations.has_message(conversation_id, newest.slot, newest.request_id)

    return stored
