"""The chat page's calls, timed: a conversation, then a message whose reply streams
back as server-sent events (start, token..., final)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from schemas.events import ANSWERED


class ChatError(Exception):
    """The gateway refused, or the reply ended without a good final event."""


@dataclass
class ChatUser:
    client: httpx.AsyncClient  # base_url is the gateway
    key: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    async def conversation(self, model: str) -> str:
        response = await self.client.post(
            "/v1/conversations", json={"model": model}, headers=self.headers
        )
        if response.status_code != 201:
            raise ChatError(f"create conversation: {response.status_code} {response.text}")
        return str(response.json()["id"])

    def post(self, conversation: str, content: str, max_tokens: int) -> Any:
        """The streaming POST (an async context manager yielding the response)."""
        body = {"content": content, "max_tokens": max_tokens, "temperature": 0}
        path = f"/v1/conversations/{conversation}/messages"
        return self.client.stream("POST", path, json=body, headers=self.headers)


@dataclass
class ReplyTimes:
    ttft_s: float  # from sending the message to the first token event
    total_s: float
    tokens: int  # completion tokens of the final event
    # From the final event's usage, both counted from the gateway producing the prompt:
    queue_s: float  # until the worker handed it to the engine (Kafka, waiting for a slot)
    worker_ttft_s: float  # until the engine's first token


async def events(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of a reply; keep-alive comments and [DONE] are skipped."""
    async for line in response.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


async def timed_reply(
    user: ChatUser, conversation: str, content: str, max_tokens: int
) -> ReplyTimes:
    started = time.perf_counter()
    ttft: float | None = None
    async with user.post(conversation, content, max_tokens) as response:
        if response.status_code != 200:
            raise ChatError(f"{response.status_code} {(await response.aread())[:200]!r}")
        async for event in events(response):
            if event["type"] == "token" and ttft is None:
                ttft = time.perf_counter() - started
            elif event["type"] == "error":
                raise ChatError(event["error"])
            elif event["type"] == "final":
                if event["finish_reason"] not in ANSWERED or ttft is None:
                    raise ChatError(f"final {event['finish_reason']}: {event['error']}")
                usage = event["usage"]
                total = time.perf_counter() - started
                queue_s, worker_ttft_s = usage["queue_ms"] / 1000, usage["ttft_ms"] / 1000
                return ReplyTimes(ttft, total, usage["completion_tokens"], queue_s, worker_ttft_s)
    raise ChatError("stream ended without a final event")


async def held_reply(
    user: ChatUser, conversation: str, content: str, started: asyncio.Event
) -> None:
    """Open a reply stream, set `started` on its start event, and keep reading until
    cancelled (the model's worker takes nothing: only keep-alives follow)."""
    async with user.post(conversation, content, 16) as response:
        if response.status_code != 200:
            raise ChatError(f"{response.status_code} {(await response.aread())[:200]!r}")
        async for event in events(response):
            if event["type"] == "start":
                started.set()
            elif event["type"] in ("error", "final"):
                raise ChatError(f"stream ended during the hold: {event}")
    raise ChatError("stream closed during the hold")
