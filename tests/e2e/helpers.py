"""Helpers for end-to-end tests: keys, conversations, and reading server-sent events."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from infra.roles import GatewayProcess, PersistProcess, WorkerProcess
from producers.keys import create_key
from tandoor.settings import Settings

SHED_BACKLOG = 2  # prompts waiting on the `big` model before the free tier is shed


@dataclass
class Stack:
    url: str
    settings: Settings
    gateways: list[GatewayProcess]
    env: dict[str, str]  # what makes a role serve this stack's models
    logs: Path
    model: str  # served by the stack's worker
    big: str  # no worker: prompts wait, and the free tier falls back to `model`
    crash: str  # no worker but the ones a test starts
    worker: WorkerProcess  # serves `model`
    persist: PersistProcess


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
    for _ in range(120):
        opened = (await http.get(f"/v1/conversations/{conversation}", headers=headers)).json()
        replies = [m for m in opened["messages"] if m["role"] == "assistant"]
        if len(replies) >= count:
            return list(opened["messages"])
        await asyncio.sleep(0.25)
    raise AssertionError(f"fewer than {count} replies stored")
