"""Helpers for end-to-end tests: keys, conversations, and reading server-sent events."""

from __future__ import annotations

import json
import random
import string
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx

from producers.gateway.conversations.service import ConversationService
from schemas.events import now_ms
from tandoor.clients import cassandra_session
from tandoor.policies.api_keys import create_key
from tests.e2e.stack import Stack
from tests.waiting import eventually


def user_name(prefix: str) -> str:
    """A fresh user id of letters after `prefix`: tests that put the name in a prompt
    compare it with the stored one, and a run of digits there (`fault-11-624467`) is
    redacted as a phone number."""
    return f"{prefix}-{''.join(random.choices(string.ascii_lowercase, k=8))}"


async def auth(stack: Stack, tier: str = "plus") -> dict[str, str]:
    key, _ = await create_key(stack.settings, f"user-{uuid.uuid4().hex[:8]}", tier)
    return {"Authorization": f"Bearer {key}"}


async def new_conversation(
    http: httpx.AsyncClient, headers: dict[str, str], model: str | None = None
) -> str:
    body = {"model": model} if model else {}
    response = await http.post("/v1/conversations", json=body, headers=headers)
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


async def sse(response: httpx.Response) -> AsyncIterator[tuple[str | None, Any]]:
    """(event id, data) for each server-sent event; data is "[DONE]" or parsed JSON."""
    event_id, data = None, []
    async for line in response.aiter_lines():
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            data.append(line[6:])
        elif line == "" and data:
            text = "\n".join(data)
            yield event_id, text if text == "[DONE]" else json.loads(text)
            event_id, data = None, []


async def chat(
    http: httpx.AsyncClient,
    headers: dict[str, str],
    conversation: str,
    content: str,
    max_tokens: int = 48,
) -> list[Any]:
    body = {"content": content, "max_tokens": max_tokens, "temperature": 0}
    path = f"/v1/conversations/{conversation}/messages"
    async with http.stream("POST", path, json=body, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        return [data async for _, data in sse(response)]


def reply_text(events: list[Any]) -> str:
    return "".join(e["delta"] for e in events if isinstance(e, dict) and e["type"] == "token")


async def stored_reply(
    http: httpx.AsyncClient, headers: dict[str, str], conversation: str, count: int = 1
) -> list[Any]:
    """The conversation's messages once `count` assistant replies are stored."""

    async def messages() -> list[Any]:
        opened = (await http.get(f"/v1/conversations/{conversation}", headers=headers)).json()
        return list(opened["messages"])

    return await eventually(
        messages,
        lambda stored: sum(m["role"] == "assistant" for m in stored) >= count,
        what=f"{count} stored replies in {conversation}",
    )


async def streamed(
    http: httpx.AsyncClient, headers: dict[str, str], path: str, body: dict[str, Any]
) -> list[Any]:
    """A POST's whole event stream (a regenerate's, an edit's)."""
    async with http.stream("POST", path, json=body, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        return [data async for _, data in sse(response)]


async def unanswered(stack: Stack, conversation_id: str, message_id: str, text: str) -> str:
    """A question stored, as by a gateway that died before queueing it: no reply comes.
    Its owner's user id."""
    with cassandra_session(stack.settings, stack.settings.keyspace) as session:
        owner = session.execute(
            "SELECT user_id FROM conversations WHERE conversation_id = %s", (conversation_id,)
        ).one()
        conversations = ConversationService(session, stack.settings.served_models)
        opened = await conversations.owned(owner.user_id, conversation_id)
        await conversations.add_user_message(owner.user_id, opened, message_id, text, now_ms())
    return str(owner.user_id)
