"""Chatting over HTTP against the whole stack (see conftest.py)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import signal
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from infra.roles import GatewayProcess
from producers.gateway.conversations.protocol import provisional_title
from schemas.events import ANSWERED
from tandoor.clients import redis_client
from tandoor.policies.redis_keys import titled_key
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
from tests.queued import queued
from tests.waiting import eventually, until

pytestmark = pytest.mark.integration


async def test_a_reply_streams_in_order_and_is_stored(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    headers = await auth(stack)
    conversation = await new_conversation(http, headers)
    events = await chat(http, headers, conversation, "What is the capital of France?")
    assert events[0]["type"] == "start" and events[-1] == "[DONE]"
    final = events[-2]
    assert final["type"] == "final" and final["finish_reason"] in ANSWERED
    text = reply_text(events)
    assert "Paris" in text
    seqs = [e["seq"] for e in events if isinstance(e, dict) and "seq" in e]
    assert seqs == list(range(len(seqs)))  # in order, no duplicates
    messages = await stored_reply(http, headers, conversation)
    assert [(m["role"], m["status"]) for m in messages] == [
        ("user", "sent"),
        ("assistant", "complete"),
    ]
    assert messages[0]["content"] == "What is the capital of France?"
    assert messages[1]["content"] == text


async def test_the_second_turn_carries_the_first(stack: Stack, http: httpx.AsyncClient) -> None:
    headers = await auth(stack)
    conversation = await new_conversation(http, headers)
    first = await chat(http, headers, conversation, "My name is Ada. What is 2 + 2?")
    await stored_reply(http, headers, conversation)
    second = await chat(http, headers, conversation, "What is my name?")
    first_usage, second_usage = first[-2]["usage"], second[-2]["usage"]
    # The second prompt holds the first question and answer: the model saw them.
    assert second_usage["prompt_tokens"] > (
        first_usage["prompt_tokens"] + first_usage["completion_tokens"]
    )


@contextlib.contextmanager
def persistence_paused(stack: Stack) -> Iterator[Callable[[], None]]:
    """The persistence consumer stopped (SIGSTOP, for less than its group session):
    replies end on the stream but are not stored yet. Yields what resumes it."""
    proc = stack.persist.proc
    assert proc is not None
    proc.send_signal(signal.SIGSTOP)
    resume = functools.partial(proc.send_signal, signal.SIGCONT)
    try:
        yield resume
    finally:
        resume()


async def test_a_follow_up_sent_as_the_reply_ends_carries_it(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    """The next turn waits for the reply to be stored; it does not go without it."""
    headers = await auth(stack)
    conversation = await new_conversation(http, headers)
    with persistence_paused(stack) as resume:
        first = await chat(http, headers, conversation, "Count from 1 to 40.", max_tokens=24)
        asyncio.get_running_loop().call_later(1.0, resume)  # while the follow-up waits
        second = await chat(http, headers, conversation, "And?", max_tokens=4)
    first_usage, second_usage = first[-2]["usage"], second[-2]["usage"]
    assert first_usage["completion_tokens"] == 24  # longer than the follow-up's own turn
    assert second_usage["prompt_tokens"] > (
        first_usage["prompt_tokens"] + first_usage["completion_tokens"]
    )


async def test_regenerate_as_the_reply_ends_replaces_it_though_stored_after(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    """Persistence still behind when the regenerate's wait runs out: the old reply,
    stored after the regenerate, is still hidden, not shown beside the new one."""
    headers = await auth(stack)
    conversation = await new_conversation(http, headers)
    path = f"/v1/conversations/{conversation}/regenerate"
    with persistence_paused(stack) as resume:
        first = await chat(http, headers, conversation, "Name a colour.", max_tokens=16)
        async with http.stream("POST", path, json={"max_tokens": 16}, headers=headers) as response:
            assert response.status_code == 200, await response.aread()
            events = sse(response)
            again = [(await anext(events))[1]]
            resume()  # the old reply is stored now, after the replace
            again += [data async for _, data in events]
    messages = await stored_reply(http, headers, conversation, count=2)
    assert [(m["role"], m["status"], m["content"]) for m in messages[1:]] == [
        ("assistant", "replaced", reply_text(first)),
        ("assistant", "complete", reply_text(again)),
    ]


async def test_regenerate_replaces_the_last_reply(stack: Stack, http: httpx.AsyncClient) -> None:
    headers = await auth(stack)
    conversation = await new_conversation(http, headers)
    await chat(http, headers, conversation, "Name a colour.", max_tokens=16)
    await stored_reply(http, headers, conversation)
    again = await streamed(
        http,
        headers,
        f"/v1/conversations/{conversation}/regenerate",
        {"max_tokens": 16, "temperature": 1.0},
    )
    assert again[0]["user_message_id"] is None and again[-2]["type"] == "final"
    messages = await stored_reply(http, headers, conversation, count=2)
    assert [(m["role"], m["status"]) for m in messages] == [
        ("user", "sent"),
        ("assistant", "replaced"),
        ("assistant", "complete"),
    ]
    assert messages[-1]["content"] == reply_text(again)


async def test_edit_reruns_from_the_edited_message(stack: Stack, http: httpx.AsyncClient) -> None:
    headers = await auth(stack)
    conversation = await new_conversation(http, headers)
    first = await chat(http, headers, conversation, "What is 2 + 2?", max_tokens=16)
    await stored_reply(http, headers, conversation)
    edited = await streamed(
        http,
        headers,
        f"/v1/conversations/{conversation}/messages/{first[0]['user_message_id']}/edit",
        {"content": "What is the capital of France?", "max_tokens": 32, "temperature": 0},
    )
    assert "Paris" in reply_text(edited)
    too_long = await http.post(  # refused before a reply runs: nothing is replaced
        f"/v1/conversations/{conversation}/messages/{edited[0]['user_message_id']}/edit",
        json={"content": "word " * 6000},
        headers=headers,
    )
    assert too_long.status_code == 413, too_long.text
    messages = await stored_reply(http, headers, conversation, count=2)
    shown = [(m["role"], m["content"]) for m in messages if m["status"] != "replaced"]
    assert shown == [("user", "What is the capital of France?"), ("assistant", reply_text(edited))]
    assert [m["status"] for m in messages[:2]] == ["replaced", "replaced"]
    unknown = await http.post(
        f"/v1/conversations/{conversation}/messages/m_nope/edit",
        json={"content": "x"},
        headers=headers,
    )
    assert unknown.status_code == 404


async def test_over_quota_is_a_429_before_anything_is_queued(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    headers = await auth(stack, tier="free")  # 2 requests a minute in this stack
    conversation = await new_conversation(http, headers)
    for _ in range(2):
        await chat(http, headers, conversation, "Hi", max_tokens=4)
    # The free band's prompts (a title job goes to the batch band).
    band = stack.settings.tiers["free"].band
    prompts_before = await queued(stack.settings, stack.model, band)
    refused = await http.post(
        f"/v1/conversations/{conversation}/messages", json={"content": "Hi again"}, headers=headers
    )
    assert refused.status_code == 429
    assert 1 <= int(refused.headers["Retry-After"]) <= 60
    assert refused.json()["error"]["type"] == "rate_limit_error"
    before = await stored_reply(http, headers, conversation, count=2)
    assert [m["content"] for m in before if m["role"] == "user"] == ["Hi", "Hi"]
    # Regenerate and edit refused the same way leave every message as it was (they hid
    # the replies they would replace before the quota said no).
    for path, body in (
        ("regenerate", {}),
        (f"messages/{before[0]['id']}/edit", {"content": "Bye"}),
    ):
        again = await http.post(
            f"/v1/conversations/{conversation}/{path}", json=body, headers=headers
        )
        assert again.status_code == 429, again.text
    key = headers["Authorization"].removeprefix("Bearer ")
    async with openai.AsyncOpenAI(api_key=key, base_url=f"{stack.url}/v1", max_retries=0) as api:
        with pytest.raises(openai.RateLimitError) as over:
            await api.chat.completions.create(
                model=stack.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
            )
    assert over.value.status_code == 429 and over.value.response.headers["Retry-After"]
    assert await queued(stack.settings, stack.model, band) == prompts_before, "a prompt queued"
    after = (await http.get(f"/v1/conversations/{conversation}", headers=headers)).json()
    assert [(m["id"], m["status"]) for m in after["messages"]] == [
        (m["id"], m["status"]) for m in before
    ]


async def test_a_message_too_long_for_the_model_is_a_413(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    headers = await auth(stack)
    conversation = await new_conversation(http, headers)
    response = await http.post(
        f"/v1/conversations/{conversation}/messages",
        json={"content": "word " * 6000},
        headers=headers,
    )
    assert response.status_code == 413
    assert "2048" in response.json()["error"]["message"]


async def test_users_cannot_chat_in_each_others_conversations(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    """With a reply of alice's running (on the model whose worker takes nothing): with
    none, following it was a 404 for alice too, and proved nothing."""
    alice, bob = await auth(stack), await auth(stack)
    base = f"/v1/conversations/{await new_conversation(http, alice, stack.big)}"
    async with http.stream("POST", f"{base}/messages", json={"content": "hi"}, headers=alice) as r:
        assert r.status_code == 200, await r.aread()  # queued; leaving it is not stop
    post = await http.post(f"{base}/messages", json={"content": "hi"}, headers=bob)
    assert post.status_code == 404
    assert (await http.post(f"{base}/stop", headers=bob)).status_code == 404
    for caller, status in ((bob, 404), (alice, 200)):  # alice follows her running reply
        async with http.stream("GET", f"{base}/stream", headers=caller) as followed:
            assert followed.status_code == status
    assert (await http.post(f"{base}/stop", headers=alice)).status_code == 202


def reads(gateway: GatewayProcess) -> set[int]:
    """The partitions of `tokens` this replica reads now (its last assignment)."""
    lines = re.findall(r"gateway reads tokens partitions \[([\d, ]*)\]", gateway.log())
    return {int(p) for p in lines[-1].split(",") if p.strip()} if lines else set()


async def test_two_replicas_share_the_token_traffic(stack: Stack) -> None:
    first, second = await until(
        lambda: (reads(stack.gateways[0]), reads(stack.gateways[1])),
        lambda both: all(both),
        what="both replicas reading tokens partitions",
    )
    assert first and second and not first & second, (first, second)
    assert first | second == set(range(stack.settings.tokens_partitions))
    headers = await auth(stack)
    urls = [f"http://127.0.0.1:{g.port}" for g in stack.gateways]
    clients = [httpx.AsyncClient(base_url=url, timeout=120) for url in urls]
    try:
        conversations = [await new_conversation(c, headers) for c in clients for _ in range(2)]
        owners = [c for c in clients for _ in range(2)]
        replies = await asyncio.gather(
            *(
                chat(c, headers, conv, f"What is {i} + {i}?", max_tokens=16)
                for i, (c, conv) in enumerate(zip(owners, conversations, strict=True))
            )
        )
    finally:
        for c in clients:
            await c.aclose()
    for events in replies:  # each replica streamed whole replies from its own partitions
        assert events[0]["type"] == "start" and events[-1] == "[DONE]"
        assert events[-2]["finish_reason"] in ANSWERED and reply_text(events)


async def test_a_new_conversation_gets_a_title_from_the_model(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    headers = await auth(stack)
    conversation = await new_conversation(http, headers)  # no title yet
    named = (await http.post("/v1/conversations", json={"title": "Mine"}, headers=headers)).json()[
        "id"
    ]
    api_call = {
        "model": stack.settings.served_models[0],
        "messages": [{"role": "user", "content": "How do volcanoes form?"}],
        "max_tokens": 8,
    }
    answered = await http.post("/v1/chat/completions", json=api_call, headers=headers)
    assert answered.status_code == 200, answered.text
    await chat(http, headers, conversation, "How do volcanoes form?")
    await chat(http, headers, named, "How do volcanoes form?")

    async def title_of_conversation() -> str | None:
        opened = await http.get(f"/v1/conversations/{conversation}", headers=headers)
        return opened.json()["title"]  # type: ignore[no-any-return]

    # A background job in the batch band, in place of the first message's opening words.
    provisional = provisional_title("How do volcanoes form?")
    title = await eventually(
        title_of_conversation, lambda t: t != provisional, what=f"a title for {conversation}"
    )
    assert title and len(title) <= 60 and "\n" not in title
    sidebar = (await http.get("/v1/conversations", headers=headers)).json()["data"]
    assert {c["id"]: c["title"] for c in sidebar}[conversation] == title
    titles = {c["id"]: c["title"] for c in sidebar}
    assert titles[named] == "Mine", "a chosen title stays"
    # An OpenAI API completion asks for no title job: its conversation keeps the title
    # of its message (its job, had it asked, would have run before the page's did).
    (api_conversation,) = set(titles) - {conversation, named}
    assert titles[api_conversation] == provisional_title("How do volcanoes form?")
    redis = redis_client(stack.settings)
    try:
        assert not await redis.exists(titled_key(api_conversation)), "a title job was asked"
    finally:
        await redis.aclose()
