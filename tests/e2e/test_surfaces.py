"""The same conversation through every surface (the chat API, the OpenAI API streamed
and whole): the same refusal of a blocked term wherever it is in the conversation, the
same redaction of what the model writes, and what each client saw is what was stored."""

from __future__ import annotations

import re
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.e2e.helpers import auth, chat, new_conversation, reply_text, stored_reply
from tests.e2e.stack import BLOCKED_TERM, Stack

pytestmark = pytest.mark.integration

EMAIL = re.compile(r"[\w.+-]+@[\w-]+\.[\w.-]+")
# The model invents addresses here (the input's own would be redacted before it).
ASKED = "List three example email addresses of staff at example.com, one per line."
MAX_TOKENS = 48  # greedy (temperature 0) on every surface


def api(stack: Stack, headers: dict[str, str]) -> openai.AsyncOpenAI:
    key = headers["Authorization"].removeprefix("Bearer ")
    return openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key=key, max_retries=0)


async def conversations(http: httpx.AsyncClient, headers: dict[str, str]) -> list[dict[str, Any]]:
    return list((await http.get("/v1/conversations", headers=headers)).json()["data"])


async def test_a_blocked_term_anywhere_is_refused_on_every_surface(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    headers = await auth(stack)
    conversation = await new_conversation(http, headers)
    posted = await http.post(
        f"/v1/conversations/{conversation}/messages",
        json={"content": f"Tell me about {BLOCKED_TERM} things."},
        headers=headers,
    )
    assert posted.status_code == 400 and posted.json()["error"]["type"] == "moderation_error"
    opened = (await http.get(f"/v1/conversations/{conversation}", headers=headers)).json()
    assert opened["messages"] == []

    earlier: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": f"Tell me about {BLOCKED_TERM} things."},
        {"role": "assistant", "content": "Sure."},
        {"role": "user", "content": "Go on."},  # only the last one is harmless
    ]
    async with api(stack, headers) as client:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError, match="blocked term") as refused:
                await client.chat.completions.create(
                    model=stack.model, messages=earlier, stream=stream
                )
            assert refused.value.param == "messages.1.content"  # where it is, by name
    assert [c["id"] for c in await conversations(http, headers)] == [conversation]


async def test_every_surface_shows_the_reply_redacted_as_it_is_stored(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    headers = await auth(stack)
    conversation = await new_conversation(http, headers)
    events = await chat(http, headers, conversation, ASKED, MAX_TOKENS)
    seen = {"chat": reply_text(events)}
    stored = {"chat": (await stored_reply(http, headers, conversation))[-1]["content"]}

    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": ASKED}]
    async with api(stack, headers) as client:
        whole = await client.chat.completions.create(
            model=stack.model, messages=messages, temperature=0, max_tokens=MAX_TOKENS
        )
        seen["openai"] = whole.choices[0].message.content or ""
        chunks = await client.chat.completions.create(
            model=stack.model, messages=messages, temperature=0, max_tokens=MAX_TOKENS, stream=True
        )
        seen["openai stream"] = "".join(
            [c.choices[0].delta.content or "" async for c in chunks if c.choices]
        )
    api_chats = [c["id"] for c in await conversations(http, headers) if c["id"] != conversation]
    assert len(api_chats) == 2, "one conversation per stored API call"
    for name, chat_id in zip(["openai stream", "openai"], api_chats, strict=True):  # newest first
        stored[name] = (await stored_reply(http, headers, chat_id))[-1]["content"]

    assert seen == stored, "each client saw what was stored"
    for name, text in seen.items():
        assert not EMAIL.search(text), f"{name} showed an address: {text!r}"
    assert any("[email]" in text for text in seen.values()), f"no address to redact: {seen}"


async def test_a_batch_tier_key_asks_as_a_batch_on_every_surface(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    """Straight to the batch band, a batch key's chat prompts went past admission's fair
    share: a flood of them held every other tenant's batch lines (the band looked full)."""
    headers = await auth(stack, "batch")
    conversation = await new_conversation(http, headers)
    posted = await http.post(
        f"/v1/conversations/{conversation}/messages", json={"content": "Hi"}, headers=headers
    )
    assert posted.status_code == 403 and posted.json()["error"]["code"] == "batch_tier"
    opened = (await http.get(f"/v1/conversations/{conversation}", headers=headers)).json()
    assert opened["messages"] == []
    async with api(stack, headers) as client:
        for stream in (False, True):
            with pytest.raises(openai.PermissionDeniedError, match="as a batch") as refused:
                await client.chat.completions.create(
                    model=stack.model, messages=[{"role": "user", "content": "Hi"}], stream=stream
                )
            assert refused.value.code == "batch_tier"
    assert [c["id"] for c in await conversations(http, headers)] == [conversation]
