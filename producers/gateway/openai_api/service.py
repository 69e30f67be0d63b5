"""Chat completions on top of the chat service: each call is stored as a conversation."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from starlette.types import Receive

from producers.gateway.chat.reply import ApiCall, Reply
from producers.gateway.chat.service import ChatService
from producers.gateway.chat.sse import KEEPALIVE, NO_ANSWER
from producers.gateway.chat.watch import ReplyWatch
from producers.gateway.conversations.protocol import provisional_title
from producers.gateway.errors import NOT_RETRIED, ApiError, unknown_model
from producers.gateway.openai_api.protocol import ChatCompletionRequest
from schemas.errors import error_body
from schemas.events import (
    TEMPLATE_REFUSED,
    TOO_LONG_FOR_ENGINE,
    ChatMessage,
    FinalEvent,
    TokenEvent,
)
from tandoor.policies.api_keys import Principal
from tandoor.policies.moderation import Moderator, OutputFilter

log = logging.getLogger(__name__)

RESTARTED = (
    "the worker generating this reply failed after part of it was sent, and another "
    "could not continue it; the text above is incomplete: please retry"
)

FINISH = {"stop": "stop", "length": "length"}
STOPPED = (
    "the reply was stopped before its end (Stop on the chat page, the conversation "
    "deleted, or a cancel); the text is incomplete"
)


async def start_completion(
    chat: ChatService, caller: Principal, body: ChatCompletionRequest
) -> Reply:
    if body.model not in chat.deps.settings.models:
        raise unknown_model(body.model)
    # Every message, as the chat surface checks each message it is sent.
    checked = [(m.content, f"messages.{i}.content") for i, m in enumerate(body.messages)]
    texts = await chat.deps.checks.all_moderated(checked)
    *history, last = body.chat_messages(texts)
    if last.role != "user":
        raise ApiError(400, "the last message must be from the user", param="messages")
    if body.end_user:
        log.info("completion for end user %r of %s", body.end_user, caller.user_id)
    affinity = body.prompt_cache_key or opening_affinity([*history, last])
    title, store = provisional_title(last.content), body.store is not False
    call = ApiCall(body.model, title, store=store, affinity=affinity)
    return await chat.reply(caller, call, history, last.content, body.reply_options())


def opening_affinity(messages: list[ChatMessage]) -> str:
    """The same for every turn of one chat: its messages up to its first question (the
    client sends the whole history each time)."""
    opening: list[list[str]] = []
    for message in messages:
        opening.append([message.role, message.content])
        if message.role == "user":
            break
    return "opening:" + hashlib.blake2b(orjson.dumps(opening), digest_size=16).hexdigest()


async def completion_body(reply: Reply, moderator: Moderator) -> dict[str, Any]:
    """The whole reply as one chat.completion object, through output moderation."""
    text: list[str] = []
    async for item in reply.watch.events():
        if item is None:
            continue
        if isinstance(item.event, TokenEvent):
            text.append(item.event.delta)
            continue
        final = _checked(item.event)
        content = moderator.check_output(final.text)  # as stored, as the stream shows it
        return {
            "id": f"chatcmpl-{reply.request_id}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": final.model,
            "choices": [
                {
                    "index": 0,
                    "finish_reason": FINISH[final.finish_reason],
                    "message": {"role": "assistant", "content": content},
                }
            ],
            "usage": _usage(final),
        }
    raise ApiError(504, NO_ANSWER, kind="timeout_error")


async def completion_chunks(
    reply: Reply, include_usage: bool, make_filter: Callable[[], OutputFilter]
) -> AsyncIterator[str]:
    """The reply as chat.completion.chunk events, through the same streaming redaction as
    the chat surface (it may hold back a last word), then [DONE]. A client cannot take
    text back: a re-run (a worker failed) after text was sent ends the stream with an
    error instead of a second, different text; before any text it is followed quietly."""
    base = {
        "id": f"chatcmpl-{reply.request_id}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": reply.model,
    }
    yield _data(
        {**base, "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}
    )
    attempt, next_seq, sent, redactor = 0, 0, False, make_filter()
    raw, gap = "", False  # the text received; a missing event holds the rest for the final
    async for item in reply.watch.events():
        if item is None:  # a quiet while (queued): proxies cut an idle connection
            yield KEEPALIVE
            continue
        event = item.event
        if event.attempt < attempt:
            yield ""
            continue  # a late event of an abandoned attempt
        if event.attempt > attempt:
            if sent:
                yield _error(RESTARTED, "server_error", "restarted")
                break
            attempt, next_seq, redactor, raw, gap = event.attempt, 0, make_filter(), "", False
        if isinstance(event, TokenEvent):
            if event.seq > next_seq:
                gap = True
            text = ""
            if event.seq == next_seq and not gap:  # a lower seq was delivered twice
                next_seq, raw = event.seq + 1, raw + event.delta
                text = redactor.feed(event.delta)
            sent = sent or bool(text)
            # Nothing where the event makes no chunk: the stream writes what it holds,
            # not waiting for the next event (streaming.py).
            yield _content(base, text) if text else ""
            continue
        if not event.text.startswith(raw):  # what was sent is not the stored reply
            yield _error(RESTARTED, "server_error", "restarted")
            break
        if rest := redactor.feed(event.text[len(raw) :]) + redactor.flush():
            yield _content(base, rest)
        if (refused := _refusal(event)) is not None:  # as the same request unstreamed
            yield _data(error_body(refused.message, refused.kind, refused.param, refused.code))
            break
        yield _data(
            {
                **base,
                "choices": [
                    {"index": 0, "delta": {}, "finish_reason": FINISH[event.finish_reason]}
                ],
            }
        )
        if include_usage:
            yield _data({**base, "choices": [], "usage": _usage(event)})
        break
    else:
        yield _error(NO_ANSWER, "timeout_error")  # as completion_body's 504
    yield "data: [DONE]\n\n"


async def stopped_if_left(
    chunks: AsyncIterator[str], watch: ReplyWatch, stop: Callable[[], None]
) -> AsyncGenerator[str]:
    """The stream's chunks; `stop` is called if they end before the reply did: the
    client went (a break, a timeout, a write too slow), or the stream ended while the
    reply ran on (re-run after text was sent, no event in time). The client cannot
    resume it, so the reply would run on for no one."""
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        if watch.final is None:
            stop()


async def unless_left(
    body: Awaitable[dict[str, Any]], receive: Receive, stop: Callable[[], None]
) -> dict[str, Any] | None:
    """The unstreamed reply, or None if the client goes first (an SDK's timeout, a
    closed connection): `stop` is called, as for a stream. Run on, it was charged to its
    end, held a stream slot, and the SDK's retry ran a second one beside it. So too when
    no answer came in time (a 504): the reply may run on, its events lost (a stop of a
    reply that has ended does nothing)."""
    answering = asyncio.ensure_future(body)
    leaving = asyncio.ensure_future(_left(receive))
    try:
        await asyncio.wait({answering, leaving}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        leaving.cancel()
        if not answering.done():  # the client went, or this handler was cancelled
            answering.cancel()
            stop()
            await asyncio.gather(answering, return_exceptions=True)
    if answering.cancelled():
        return None
    if isinstance(failed := answering.exception(), ApiError) and failed.status == 504:
        stop()
    return answering.result()


async def _left(receive: Receive) -> None:
    """Returns when the client disconnects: the body has been read, so the server's
    next message is the disconnect (sent at the latest when the response is)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _checked(final: FinalEvent) -> FinalEvent:
    if (refused := _refusal(final)) is not None:
        raise refused
    return final


def _refusal(final: FinalEvent) -> ApiError | None:
    """How a reply that did not finish is answered (streamed: as its error chunk)."""
    if final.finish_reason == "expired":
        return ApiError(
            503,
            "the model was busy and the request expired in the queue; retry",
            kind="service_unavailable",
            headers={"Retry-After": "5"},
        )
    if final.failed_with(TOO_LONG_FOR_ENGINE):
        return ApiError(
            400,
            f"context_length_exceeded: {final.error}",
            param="messages",
            code="context_length_exceeded",
        )
    if final.failed_with(TEMPLATE_REFUSED):
        return ApiError(400, final.error or "", param="messages")
    if final.finish_reason == "cancelled":  # not "stop": a cut-off answer is no answer
        # Not retried (NOT_RETRIED): the retry ran the stopped completion again, to its
        # end, charged twice.
        return ApiError(409, STOPPED, code="cancelled", headers=NOT_RETRIED)
    if final.finish_reason not in FINISH:  # not the request's fault: an SDK retries a 5xx
        return ApiError(
            502,
            f"the model failed to answer ({final.error or 'no reason given'}); retry",
            kind="api_error",
            headers={"Retry-After": "1"},
        )
    return None


def _usage(final: FinalEvent) -> dict[str, Any]:
    usage = final.usage
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def _content(base: dict[str, Any], text: str) -> str:
    return _data(
        {**base, "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    )


def _error(message: str, kind: str, code: str | None = None) -> str:
    return _data(error_body(message, kind, None, code))


def _data(obj: dict[str, Any]) -> str:
    return f"data: {orjson.dumps(obj).decode()}\n\n"
