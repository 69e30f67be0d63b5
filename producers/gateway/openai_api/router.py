"""Routes of the OpenAI-compatible API."""

from __future__ import annotations

from functools import partial
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse

from producers.gateway.auth import Caller
from producers.gateway.chat.router import SSE_HEADERS, Chat
from producers.gateway.errors import ApiError, unknown_model
from producers.gateway.json_body import StrictJsonRoute
from producers.gateway.openai_api.protocol import ChatCompletionRequest
from producers.gateway.openai_api.service import (
    completion_body,
    completion_chunks,
    start_completion,
    stopped_if_left,
    unless_left,
)
from producers.gateway.services import Services, services
from producers.gateway.streaming import ReplyStream

router = APIRouter(prefix="/v1", tags=["openai"], route_class=StrictJsonRoute)
CLIENT_LEFT = 499  # nginx's "client closed request": logged, read by no one


@router.get("/models")
async def models(caller: Caller, deps: Annotated[Services, Depends(services)]) -> dict[str, Any]:
    del caller  # a key is needed, whoever holds it
    return {"object": "list", "data": [_model(deps, name) for name in deps.settings.models]}


@router.get("/models/{model}")  # served names are topic names: no slash
async def model(
    model: str, caller: Caller, deps: Annotated[Services, Depends(services)]
) -> dict[str, Any]:
    del caller
    if model not in deps.settings.models:
        raise unknown_model(model)
    return _model(deps, model)


def _model(deps: Services, name: str) -> dict[str, Any]:
    display_name = deps.settings.models[name].display_name or name
    # display_name beside OpenAI's fields
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "tandoor",
        "display_name": display_name,
    }


@router.post("/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, caller: Caller, svc: Chat, request: Request
) -> Response:
    moderator = svc.deps.checks.moderator
    if not body.stream:  # its connection is held as long as a stream's: counted alike
        slot = svc.deps.streams.take()
        try:
            reply = await start_completion(svc, caller, body)
            stop = partial(svc.running.stop_left, caller, reply.conversation.id, reply.request_id)
            tagged = {"X-Request-Id": reply.request_id}  # as the SDK reads it, errors too
            try:
                answer = await unless_left(completion_body(reply, moderator), request.receive, stop)
            except ApiError as refused:
                refused.headers.update(tagged)
                raise
            if answer is None:
                return Response(status_code=CLIENT_LEFT)
            return JSONResponse(answer, headers=tagged)
        finally:
            slot.release()
    with svc.deps.streams.reserve() as slot:
        reply = await start_completion(svc, caller, body)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = stopped_if_left(
            completion_chunks(reply, include_usage, moderator.output_filter),
            reply.watch,
            partial(svc.running.stop_left, caller, reply.conversation.id, reply.request_id),
        )
        timeout = svc.deps.settings.gateway_write_timeout_s
        headers = {**SSE_HEADERS, "X-Request-Id": reply.request_id}
        return ReplyStream(
            chunks, slot, timeout, headers, resumable=False, queued=reply.watch.queued
        )
