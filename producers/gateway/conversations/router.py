"""Routes of the conversations API; the work is in ConversationService."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Response

from producers.gateway.auth import Caller
from producers.gateway.chat.router import Chat
from producers.gateway.conversations.protocol import (
    Conversation,
    ConversationPage,
    ConversationWithMessages,
    CreateConversation,
    RenameConversation,
)
from producers.gateway.conversations.service import ConversationService
from producers.gateway.json_body import StrictJsonRoute
from producers.gateway.services import Services, services

router = APIRouter(prefix="/v1/conversations", tags=["conversations"], route_class=StrictJsonRoute)


def conversations(deps: Annotated[Services, Depends(services)]) -> ConversationService:
    return deps.conversations


Conversations = Annotated[ConversationService, Depends(conversations)]


@router.post("", status_code=201)
async def create(body: CreateConversation, caller: Caller, svc: Conversations) -> Conversation:
    return await svc.create(caller.user_id, body.model, body.title)


@router.get("")
async def list_conversations(
    caller: Caller,
    svc: Conversations,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    cursor: Annotated[str | None, Query(max_length=200, description="from next_cursor")] = None,
) -> ConversationPage:
    return await svc.page(caller.user_id, limit, cursor)


@router.get("/{conversation_id}")
async def get(conversation_id: str, caller: Caller, svc: Conversations) -> ConversationWithMessages:
    return await svc.get(caller.user_id, conversation_id)


@router.patch("/{conversation_id}")
async def rename(
    conversation_id: str, body: RenameConversation, caller: Caller, svc: Conversations
) -> Conversation:
    return await svc.rename(caller.user_id, conversation_id, body.title)


@router.delete("/{conversation_id}", status_code=204)
async def delete(conversation_id: str, caller: Caller, svc: Conversations, chat: Chat) -> Response:
    await chat.running.stop_if_running(caller, conversation_id)
    await svc.delete(caller.user_id, conversation_id)
    # A reply another tab claimed meanwhile passed its checks before the rows went, and
    # ran on for a chat that is gone, charged, holding a stream slot: stopped too.
    await chat.running.stop_if_running(caller, conversation_id, owned=True)
    return Response(status_code=204)
