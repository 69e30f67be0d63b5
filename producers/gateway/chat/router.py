"""Routes for chatting: post a message (the reply streams back as SSE), stop, resume."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Annotated

from fastapi import APIRouter, Depends, Header
from fastapi.responses import StreamingResponse

from producers.gateway.auth import Caller
from producers.gateway.chat.control import Resumed
from producers.gateway.chat.protocol import PostMessage, Regenerate
from producers.gateway.chat.reply import Reply
from producers.gateway.chat.service import ChatService
from producers.gateway.chat.sse import ResumePoint, frame, reply_frames, reply_tag
from producers.gateway.json_body import StrictJsonRoute
from producers.gateway.services import Services, services
from producers.gateway.streaming import ReplyStream, Slot
from tandoor.policies.moderation import OutputFilter

router = APIRouter(prefix="/v1/conversations", tags=["chat"], route_class=StrictJsonRoute)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def chat(deps: Annotated[Services, Depends(services)]) -> ChatService:
    return deps.chat


Chat = Annotated[ChatService, Depends(chat)]


@router.post("/{conversation_id}/messages", response_class=StreamingResponse)
async def post_message(
    conversation_id: str, body: PostMessage, caller: Caller, svc: Chat
) -> StreamingResponse:
    """Send a message; the reply streams back as server-sent events."""
    with svc.deps.streams.reserve() as slot:
        return _streamed(await svc.post(caller, conversation_id, body), svc, slot)


@router.post("/{conversation_id}/regenerate", response_class=StreamingResponse)
async def regenerate(
    conversation_id: str, caller: Caller, svc: Chat, body: Regenerate | None = None
) -> StreamingResponse:
    """A fresh reply to the last message; the previous reply is kept as replaced."""
    with svc.deps.streams.reserve() as slot:
        reply = await svc.regenerate(caller, conversation_id, body or Regenerate())
        return _streamed(reply, svc, slot)


@router.post("/{conversation_id}/messages/{message_id}/edit", response_class=StreamingResponse)
async def edit(
    conversation_id: str, message_id: str, body: PostMessage, caller: Caller, svc: Chat
) -> StreamingResponse:
    """Change a message of yours and rerun from there; what followed it is replaced."""
    with svc.deps.streams.reserve() as slot:
        return _streamed(await svc.edit(caller, conversation_id, message_id, body), svc, slot)


def _streamed(reply: Reply, svc: ChatService, slot: Slot) -> ReplyStream:
    start = frame(
        {
            "type": "start",
            "request_id": reply.request_id,
            "conversation_id": reply.conversation.id,
            "model": reply.model,
            "user_message_id": reply.user_message_id,
            "summarized": reply.summarized,  # older turns went in as a summary
        },
        # Nothing of the reply sent yet, but named: a client cut off before its first
        # text resumed without an id, and was given whatever reply ran by then (one
        # another tab started after this one ended), under this question.
        f"{reply_tag(reply.request_id)}.1.0",
    )

    async def stream() -> AsyncIterator[str]:
        yield start
        async for chunk in reply_frames(reply.watch.events(), svc.output_filter):
            yield chunk

    headers = {**SSE_HEADERS, "X-Request-Id": reply.request_id}
    timeout = svc.deps.settings.gateway_write_timeout_s
    watch = reply.watch
    return ReplyStream(
        stream(), slot, timeout, headers, queued=watch.queued, ending=lambda: watch.ending
    )


@router.post("/{conversation_id}/stop", status_code=202)
async def stop(conversation_id: str, caller: Caller, svc: Chat) -> dict[str, str]:
    """Stop the reply being generated; its partial text is kept as stopped."""
    request_id = await svc.running.stop(caller, conversation_id)
    return {"request_id": request_id, "status": "cancelling"}


@router.get("/{conversation_id}/stream", response_class=StreamingResponse)
async def resume(
    conversation_id: str,
    caller: Caller,
    svc: Chat,
    last_event_id: Annotated[str | None, Header(max_length=64)] = None,
) -> StreamingResponse:
    """Resume the current reply after `Last-Event-ID` (or from its start)."""
    resume = ResumePoint.parse(last_event_id)  # a bad id is a 400 whatever else holds
    with svc.deps.streams.reserve(resumed_by=caller.user_id) as slot:
        reply = resume.reply if resume else None
        resumed = await svc.running.resume(caller, conversation_id, reply)
        record = resumed.record
        # As a post's, without an id (Last-Event-ID stays the text's): a client whose
        # post was cut before its start learns here the message's id and that a stop
        # can reach the reply.
        start = frame(
            {
                "type": "start",
                "request_id": record["request_id"],
                "conversation_id": conversation_id,
                "model": record.get("model"),
                "user_message_id": record.get("user_message_id"),
                "resumed": True,
            }
        )

        headers = {**SSE_HEADERS, "X-Request-Id": record["request_id"]}
        timeout = svc.deps.settings.gateway_write_timeout_s
        frames = resumed_frames(start, resumed, svc.output_filter, resume)
        return ReplyStream(frames, slot, timeout, headers, ending=lambda: resumed.ending)


async def resumed_frames(
    start: str, resumed: Resumed, make_filter: Callable[[], OutputFilter], at: ResumePoint | None
) -> AsyncGenerator[str, None]:
    """`start`, then the resumed reply's frames. Its reader (a Kafka consumer) closes
    with them, however they end: left to the garbage collector, a reader the final had
    ended the stream before stayed open (the events refer back to `resumed`: a cycle),
    and a gateway kept three fetching long after their streams were over."""
    async with contextlib.aclosing(resumed.events):
        yield start
        async for chunk in reply_frames(resumed.events, make_filter, at):
            yield chunk
