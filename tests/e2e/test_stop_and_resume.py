"""Stopping a reply, deleting its chat mid-answer, and closing the tab (which is not
stop), over HTTP against the whole stack (see conftest.py)."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from producers.gateway.conversations.protocol import provisional_title
from tandoor.clients import redis_client
from tandoor.policies.redis_keys import inflight_key
from tests.e2e.helpers import (
    auth,
    chat,
    new_conversation,
    reply_text,
    sse,
    stored_reply,
    streamed,
)
from tests.e2e.stack import Stack
from tests.ops import samples
from tests.waiting import eventually

pytestmark = pytest.mark.integration

LONG_STORY = "Write a very long story about a dragon."


async def long_story_until(
    http: httpx.AsyncClient,
    headers: dict[str, str],
    conversation: str,
    midway: Callable[[], Awaitable[httpx.Response]],
    status: int,
) -> list[Any]:
    """A long reply's events; `midway` is sent at its second token and answers `status`."""
    body = {"content": LONG_STORY, "max_tokens": 600}
    path = f"/v1/conversations/{conversation}/messages"
    events: list[Any] = []
    async with http.stream("POST", path, json=body, headers=headers) as response:
        async for _, data in sse(response):
            events.append(data)
            if isinstance(data, dict) and data["type"] == "token" and len(events) == 3:
                assert (await midway()).status_code == status
    assert events[-2]["type"] == "final" and events[-2]["finish_reason"] == "cancelled"
    assert 0 < events[-2]["usage"]["completion_tokens"] < 600
    return events


async def test_stop_mid_answer_keeps_the_partial_reply(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    headers = await auth(stack)
    conversation = await new_conversation(http, headers)
    stop = functools.partial(http.post, f"/v1/conversations/{conversation}/stop", headers=headers)
    events = await long_story_until(http, headers, conversation, stop, 202)
    messages = await stored_reply(http, headers, conversation)
    assert messages[-1]["status"] == "stopped" and messages[-1]["content"] == reply_text(events)


async def test_a_reply_whose_record_redis_lost_can_still_be_stopped(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    """Redis restarted empty mid-reply (its record gone): stop answered 409, no reply
    running, while it ran on to max_tokens (and a regenerate could run beside it). Its
    gateway writes the record back within seconds."""
    headers = await auth(stack)
    conversation = await new_conversation(http, headers)
    redis = redis_client(stack.settings)
    answers: list[httpx.Response] = []

    async def stop_status() -> int:
        answers.append(await http.post(f"/v1/conversations/{conversation}/stop", headers=headers))
        return answers[-1].status_code

    async def lose_the_record_then_stop() -> httpx.Response:
        await redis.delete(inflight_key(conversation))
        await eventually(stop_status, lambda status: status != 409, what="the reply found again")
        return answers[-1]

    try:
        events = await long_story_until(http, headers, conversation, lose_the_record_then_stop, 202)
    finally:
        await redis.aclose()
    messages = await stored_reply(http, headers, conversation)
    assert messages[-1]["status"] == "stopped" and messages[-1]["content"] == reply_text(events)


async def test_a_chat_whose_first_reply_was_stopped_is_titled_by_the_next_reply(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    """The title job ran only after an answered first reply: one stopped, then answered
    again by a regenerate or by the next message, left the chat named by its first
    message's opening words for good."""
    headers = await auth(stack)

    async def stopped_first_reply() -> str:
        conversation = await new_conversation(http, headers)
        stop = functools.partial(
            http.post, f"/v1/conversations/{conversation}/stop", headers=headers
        )
        await long_story_until(http, headers, conversation, stop, 202)
        return conversation

    regenerated, followed = await stopped_first_reply(), await stopped_first_reply()
    path = f"/v1/conversations/{regenerated}/regenerate"
    assert reply_text(await streamed(http, headers, path, {"max_tokens": 8}))
    assert reply_text(await chat(http, headers, followed, "Say hi.", max_tokens=8))
    provisional = provisional_title(LONG_STORY)
    for conversation in (regenerated, followed):

        async def title(conversation: str = conversation) -> str:
            opened = await http.get(f"/v1/conversations/{conversation}", headers=headers)
            return str(opened.json()["title"])

        given = await eventually(title, lambda t: t != provisional, what="the model's title")
        assert given.strip() and len(given) <= 60


async def test_deleting_a_chat_mid_answer_stops_its_reply_and_frees_the_stream(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    """Left running, nobody could stop it (stop and resume answer 404 once the chat is
    gone): it ran to max_tokens, charged, holding a free user's only stream slot."""
    headers = await auth(stack, "free")
    conversation = await new_conversation(http, headers)
    delete = functools.partial(http.delete, f"/v1/conversations/{conversation}", headers=headers)
    await long_story_until(http, headers, conversation, delete, 204)  # stopped: < 600

    async def streams_held() -> int | None:
        usage = (await http.get("/v1/usage", headers=headers)).json()
        return usage["limits"]["concurrent_streams"]["used"]  # type: ignore[no-any-return]

    # Its slot, not merely one of the tier's two: none is held once it ended.
    await eventually(streams_held, lambda held: held == 0, what="the stream slot freed")
    next_chat = await new_conversation(http, headers)
    reply = await chat(http, headers, next_chat, "Say hi.", max_tokens=4)
    assert reply_text(reply)


async def test_stop_before_a_worker_takes_the_prompt_ends_the_reply_at_once(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    """`big`'s worker takes nothing: the prompt waits in Kafka. Stop answers it as
    cancelled there and then: the stream ends, the reply is stored as stopped, and the
    conversation takes a new message. It waited for a worker to reach the prompt (the
    queue's wait budget and more), refusing new messages meanwhile."""
    headers = await auth(stack)
    conversation = await new_conversation(http, headers, stack.big)
    path = f"/v1/conversations/{conversation}/messages"
    for attempt in range(2):  # the second: the conversation took a new message
        events: list[Any] = []
        body = {"content": f"Name a colour ({attempt}).", "max_tokens": 8}
        async with http.stream("POST", path, json=body, headers=headers) as response:
            assert response.status_code == 200, await response.aread()
            async for _, data in sse(response):
                events.append(data)
                if isinstance(data, dict) and data["type"] == "start":
                    stop = await http.post(
                        f"/v1/conversations/{conversation}/stop", headers=headers
                    )
                    assert stop.status_code == 202, stop.text
        final = events[-2]
        assert final["type"] == "final" and final["finish_reason"] == "cancelled", events
        assert reply_text(events) == ""
    stored = await stored_reply(http, headers, conversation, count=2)
    assert [(m["role"], m["status"], m["content"]) for m in stored][1::2] == [
        ("assistant", "stopped", ""),
        ("assistant", "stopped", ""),
    ]


async def test_closing_the_tab_does_not_stop_generation_and_resume_works(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    headers = await auth(stack)
    conversation = await new_conversation(http, headers)
    body = {"content": "Write a long story about the sea.", "max_tokens": 160, "temperature": 0}
    path = f"/v1/conversations/{conversation}/messages"
    seen: list[Any] = []
    last_id = None
    async with http.stream("POST", path, json=body, headers=headers) as response:
        async for event_id, data in sse(response):
            seen.append(data)
            last_id = event_id or last_id
            if len(seen) == 4:
                break  # the tab closes
    resume_headers = {**headers, "Last-Event-ID": str(last_id)}
    other_replica = f"http://127.0.0.1:{stack.gateways[1].port}"  # the reconnect lands there
    async with (
        httpx.AsyncClient(base_url=other_replica, timeout=120) as other,
        other.stream(
            "GET", f"/v1/conversations/{conversation}/stream", headers=resume_headers
        ) as response,
    ):
        assert response.status_code == 200
        rest = [data async for _, data in sse(response)]
    assert rest[-1] == "[DONE]" and rest[-2]["type"] == "final"
    messages = await stored_reply(http, headers, conversation)
    assert messages[-1]["status"] == "complete"
    assert reply_text(seen) + reply_text(rest) == messages[-1]["content"]


async def test_a_reconnect_before_the_first_text_gets_its_own_reply_or_a_404(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    """The start event had no id: a client cut off before the first text resumed without
    one, and was given whatever reply ran by then, one another tab started after its own
    ended, under its question. (`big`'s worker takes nothing: the prompts wait.)"""
    headers = await auth(stack)
    conversation = await new_conversation(http, headers, stack.big)
    path = f"/v1/conversations/{conversation}"

    async def started(content: str) -> str | None:
        body = {"content": content, "max_tokens": 8}
        async with http.stream("POST", f"{path}/messages", json=body, headers=headers) as sent:
            assert sent.status_code == 200, await sent.aread()
            async for event_id, data in sse(sent):
                assert data["type"] == "start"
                return event_id  # cut off here
        return None

    first = await started("Name a colour.")
    assert first is not None and first.endswith(".1.0")
    again = {**headers, "Last-Event-ID": first}
    async with http.stream("GET", f"{path}/stream", headers=again) as resumed:
        assert resumed.status_code == 200  # its own reply, still waiting
    stop = await http.post(f"{path}/stop", headers=headers)
    assert stop.status_code == 202, stop.text
    assert (await stored_reply(http, headers, conversation))[-1]["status"] == "stopped"
    assert await started("Name another colour.") != first  # another tab's
    async with http.stream("GET", f"{path}/stream", headers=again) as resumed:
        assert resumed.status_code == 404, await resumed.aread()
    await http.post(f"{path}/stop", headers=headers)


async def test_a_resume_its_client_leaves_closes_its_kafka_reader(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    """Each resumed stream reads its reply's partition with a Kafka consumer of its own.
    One whose client left was closed only when the garbage collector came to it: after a
    chaos run a gateway kept three open, each fetching, long after every stream ended.
    (`big`'s worker takes nothing: the reply waits, and its resume with it.)"""
    headers = await auth(stack)
    conversation = await new_conversation(http, headers, stack.big)
    path = f"/v1/conversations/{conversation}"
    gateway = stack.gateways[0]

    async def readers() -> float:
        return (await samples(gateway))["tandoor_gateway_token_readers"]

    before = await readers()
    body = {"content": "Name a colour.", "max_tokens": 8}
    async with http.stream("POST", f"{path}/messages", json=body, headers=headers) as sent:
        assert sent.status_code == 200, await sent.aread()
    for _ in range(3):
        async with http.stream("GET", f"{path}/stream", headers=headers) as resumed:
            assert resumed.status_code == 200, await resumed.aread()
            await eventually(readers, lambda n: n == before + 1, what="the resume's reader")
    await eventually(readers, lambda n: n == before, what="the resumes' readers closed")
    assert (await http.post(f"{path}/stop", headers=headers)).status_code == 202
