"""The OpenAI surface shows what the chat surface shows: replies redacted as they
stream and as a whole, exactly as they are stored."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any, cast

import orjson
import pytest

from consumers.fanout import Delivered
from producers.gateway.chat.reply import Reply
from producers.gateway.errors import ApiError
from producers.gateway.openai_api.service import (
    completion_body,
    completion_chunks,
    stopped_if_left,
    unless_left,
)
from schemas.events import Event, FinalEvent
from tandoor.policies.moderation import DefaultModerator
from tests.unit.test_sse import feed, final, token

REPLY = "Write to anna.smith@example.org or call +1 415 555 0100 today."


def tokens(text: str, size: int, attempt: int = 1) -> list[Event]:
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    return [token(p, seq, attempt) for seq, p in enumerate(pieces)]


def reply_of(text: str, size: int) -> Reply:
    return replaying([*tokens(text, size), final(text)])


class Watching:
    """A reply's watch: its events, and its final event once one has arrived."""

    def __init__(self, events: list[Event]) -> None:
        self._events = events
        self.final: FinalEvent | None = None

    async def events(self) -> AsyncIterator[Delivered | None]:
        async for item in feed(*self._events):
            if item is not None and isinstance(item.event, FinalEvent):
                self.final = item.event
            yield item


def replaying(events: list[Event]) -> Reply:
    return cast(Reply, SimpleNamespace(request_id="r", model="m", watch=Watching(events)))


async def streamed(reply: Reply) -> tuple[str, list[dict[str, Any]]]:
    """The text the client saw, and the chunks that were not content."""
    moderator = DefaultModerator()
    text, others = "", []
    async for frame in completion_chunks(reply, False, moderator.output_filter):
        data = frame.removeprefix("data: ").strip()
        if data in ("[DONE]", ""):  # "": an event that made no chunk
            continue
        chunk: dict[str, Any] = orjson.loads(data)
        content = "".join(c["delta"].get("content", "") for c in chunk.get("choices", []))
        text += content
        if not content:
            others.append(chunk)
    return text, others


async def streamed_text(reply: Reply) -> str:
    return (await streamed(reply))[0]


async def test_streamed_and_whole_completions_are_redacted_as_stored() -> None:
    stored = DefaultModerator().check_output(REPLY)
    assert stored == "Write to [email] or call [phone] today."
    for size in (1, 4, 9):
        assert await streamed_text(reply_of(REPLY, size)) == stored, size
    whole = await completion_body(reply_of(REPLY, 5), DefaultModerator())
    assert whole["choices"][0]["message"]["content"] == stored


async def test_a_rerun_after_text_was_sent_ends_the_stream_with_an_error() -> None:
    first, second = "The first attempt said this", "The second attempt says that"
    text, others = await streamed(
        replaying([*tokens(first, 4)[:3], *tokens(second, 4, attempt=2), final(second, 2)])
    )
    assert text and first.startswith(text), "part of the first, and nothing of the second"
    assert others[-1]["error"]["code"] == "restarted"
    assert not any(c.get("choices") and c["choices"][0]["finish_reason"] for c in others)


async def test_a_rerun_before_any_text_is_shown_alone() -> None:
    second = "The second attempt says that"
    assert (
        await streamed_text(replaying([*tokens(second, 4, attempt=2), final(second, 2)])) == second
    )
    held = "+1 415"  # held back by the redactor: nothing was sent yet
    assert (
        await streamed_text(
            replaying([token(held, 0), *tokens(second, 4, attempt=2), final(second, 2)])
        )
        == second
    )


async def test_repeated_and_late_events_are_shown_once() -> None:
    reply = "one two three four"
    events = tokens(reply, 4)
    late = token("stale ", 9, attempt=1)
    assert (
        await streamed_text(replaying([events[0], events[0], *events[1:], final(reply)])) == reply
    )
    second = tokens(reply, 4, attempt=2)
    assert (
        await streamed_text(replaying([*second[:2], late, *second[2:], final(reply, 2)])) == reply
    )


async def test_a_continued_reply_streams_each_event_once() -> None:
    events = [*tokens(REPLY, 7)]
    republished = events[:3]
    text, others = await streamed(replaying([*events[:3], *republished, *events[3:], final(REPLY)]))
    assert not any("error" in chunk for chunk in others), others
    assert text == (await streamed_text(reply_of(REPLY, 7)))


async def test_a_missing_event_is_filled_in_from_the_final() -> None:
    events = tokens(REPLY, 7)
    text, others = await streamed(replaying([*events[:2], *events[3:], final(REPLY)]))
    assert not any("error" in chunk for chunk in others), others
    assert text == (await streamed_text(reply_of(REPLY, 7)))


async def test_text_sent_that_differs_from_the_final_ends_with_an_error() -> None:
    _, others = await streamed(replaying([*tokens("Once upon", 4), final("Twice")]))
    assert others[-1]["error"]["code"] == "restarted", others


@pytest.mark.parametrize(
    ("error", "status", "retry"),
    [
        ("prompt has 2100 tokens; the context window of m is 2048 tokens", 400, None),
        # Mistral's or Gemma's template (the OpenAI API lets such turns through): a 502
        # that the SDK retried twice, each retry charged and failing again.
        ("the chat template refused the conversation: roles must alternate", 400, None),
        ("generation failed: engine dead", 502, "1"),
        ("3 token events were not delivered: KafkaTimeoutError()", 502, "1"),
    ],
)
async def test_a_failed_completion_blames_the_request_only_when_it_was_at_fault(
    error: str, status: int, retry: str | None
) -> None:
    """A prompt the engine finds too long is the caller's (400); an engine that failed
    or token events lost are not, and an SDK retries a 5xx (every one was a 400)."""
    failed = final("").model_copy(update={"finish_reason": "error", "error": error})
    with pytest.raises(ApiError) as refused:
        await completion_body(replaying([failed]), DefaultModerator())
    assert refused.value.status == status
    assert refused.value.headers.get("Retry-After") == retry
    assert error in refused.value.message


async def test_a_queued_completion_sends_keep_alives() -> None:
    """The watch says "nothing yet" every 15 s while the prompt waits: the OpenAI stream
    dropped that and sent nothing for up to 150 s, and proxies with a 60 s idle limit
    cut it (the chat stream sent its keep-alive comment)."""

    async def quiet_then_reply() -> Any:
        yield None
        yield None
        async for item in feed(*tokens("Hi there.", 3), final("Hi there.")):
            yield item

    watch = SimpleNamespace(events=quiet_then_reply)
    reply = cast(Reply, SimpleNamespace(request_id="r", model="m", watch=watch))
    chunks = completion_chunks(reply, False, DefaultModerator().output_filter)
    frames = [f async for f in chunks if f]
    assert frames[1:3] == [": keep-alive\n\n"] * 2 and frames[-1] == "data: [DONE]\n\n"
    assert (await streamed_text(reply_of("Hi there.", 3))) == "Hi there."


@pytest.mark.parametrize(
    ("finish", "error", "kind", "code"),
    [
        ("error", "prompt has 2100 tokens; the model takes 2048", "invalid_request_error", 400),
        (
            "error",
            "the chat template refused the conversation: roles must alternate",
            "invalid_request_error",
            400,
        ),
        ("expired", None, "service_unavailable", 503),
        ("error", "the engine died", "api_error", 502),
    ],
)
async def test_a_streamed_completion_fails_as_the_same_request_unstreamed_does(
    finish: str, error: str | None, kind: str, code: int
) -> None:
    """Streamed, a prompt too long for the engine was a `server_error` (an SDK retries
    those, and it could never succeed), where the same request unstreamed is a 400."""
    failed = final("").model_copy(update={"finish_reason": finish, "error": error})
    with pytest.raises(ApiError) as unstreamed:
        await completion_body(replaying([failed]), DefaultModerator())
    assert (unstreamed.value.status, unstreamed.value.kind) == (code, kind)
    _, others = await streamed(replaying([failed]))
    chunk = others[-1]["error"]
    assert (chunk["type"], chunk["message"], chunk["param"]) == (
        kind,
        unstreamed.value.message,
        unstreamed.value.param,
    )


async def test_a_stream_its_client_leaves_is_stopped_and_one_read_to_its_end_is_not() -> None:
    stops: list[str] = []
    left = stopped_if_left(*reply_chunks(reply_of(REPLY, 4)), lambda: stops.append("stop"))
    assert await anext(left)
    await left.aclose()  # the client went after the first chunk
    whole = stopped_if_left(*reply_chunks(reply_of(REPLY, 4)), lambda: stops.append("no"))
    read_to_end = [chunk async for chunk in whole]
    assert stops == ["stop"] and read_to_end[-1] == "data: [DONE]\n\n"


async def test_a_stream_ended_because_its_reply_was_rerun_stops_the_rerun() -> None:
    """The client was told to retry (text it has cannot be taken back) while the re-run
    went on generating, charged, holding the caller's stream slot, for no one."""
    first, second = "The first attempt said this", "The second attempt says that"
    running = replaying([*tokens(first, 4)[:3], *tokens(second, 4, attempt=2)])
    stops: list[str] = []
    chunks = [c async for c in stopped_if_left(*reply_chunks(running), lambda: stops.append("x"))]
    assert '"restarted"' in chunks[-2] and stops == ["x"]


def reply_chunks(reply: Reply) -> tuple[AsyncIterator[str], Any]:
    """A reply's chunks, and its watch."""
    chunks = completion_chunks(reply, False, DefaultModerator().output_filter)
    return chunks, reply.watch


async def test_each_event_yields_a_chunk_or_nothing_before_the_next_is_awaited() -> None:
    """As on the chat API (test_sse.py): an event held whole by the redaction kept the
    chunk before it from going out until the next event."""
    consumed = 0
    events = [token("Hello there, ", 0), token("wor", 1), token("ld. ", 2)]

    async def counted() -> AsyncIterator[Any]:
        nonlocal consumed
        async for item in feed(*events, final("Hello there, world. ")):
            consumed += 1
            yield item

    reply = cast(
        Reply, SimpleNamespace(request_id="r", model="m", watch=SimpleNamespace(events=counted))
    )
    chunks = completion_chunks(reply, False, DefaultModerator().output_filter)
    yielded_after = [consumed async for _ in chunks]
    assert {1, 2, 3} <= set(yielded_after)


async def test_an_unstreamed_completion_whose_client_went_is_stopped_without_an_error() -> None:
    """Cancelled, the reply task was not yet done when its result was asked for: every
    client that went was a 500 with a traceback in the log (and in the 5xx alerts)."""
    stops: list[str] = []
    started = asyncio.Event()

    async def never_answered() -> dict[str, Any]:
        started.set()
        await asyncio.Event().wait()
        return {}

    async def client_goes() -> dict[str, Any]:
        await started.wait()
        return {"type": "http.disconnect"}

    answer = await unless_left(never_answered(), client_goes, lambda: stops.append("stop"))
    assert answer is None and stops == ["stop"]

    async def client_stays() -> dict[str, Any]:
        await asyncio.Event().wait()
        return {}

    async def answered() -> dict[str, Any]:
        return {"id": "chatcmpl-r"}

    assert await unless_left(answered(), client_stays, lambda: stops.append("no")) == {
        "id": "chatcmpl-r"
    }
    assert stops == ["stop"]


async def test_a_stream_that_gets_no_answer_ends_as_the_unstreamed_call_does() -> None:
    """Its error chunk had no `param` (every error body has one), and was a
    `server_error` where the same call unstreamed is a 504 `timeout_error`."""
    with pytest.raises(ApiError) as unstreamed:
        await completion_body(replaying([token("Hi", 0)]), DefaultModerator())
    _, others = await streamed(replaying([token("Hi", 0)]))
    error = others[-1]["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["message"]) == (unstreamed.value.kind, unstreamed.value.message)
    running = replaying([*tokens("The first said this", 4)[:3], *tokens("Then", 4, attempt=2)])
    _, others = await streamed(running)
    assert set(others[-1]["error"]) == {"message", "type", "param", "code"}
    assert others[-1]["error"]["code"] == "restarted"


async def test_an_unstreamed_completion_that_got_no_answer_is_stopped_as_a_stream_is() -> None:
    """No event in time: a 504, and the reply (it may run on, its events lost) was left
    running for no one, while the SDK retried the call twice beside it. The stream in
    the same case stops it."""
    stops: list[str] = []

    async def client_stays() -> dict[str, Any]:
        await asyncio.Event().wait()
        return {}

    unanswered = completion_body(replaying([token("Hi", 0)]), DefaultModerator())
    with pytest.raises(ApiError) as timed_out:
        await unless_left(unanswered, client_stays, lambda: stops.append("stop"))
    assert timed_out.value.status == 504 and stops == ["stop"]
