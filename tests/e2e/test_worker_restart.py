"""kill -9 of the worker mid-reply: the open stream shows a restart event and then the
rerun, never repeated text, and the conversation stores the one finished reply."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from infra.roles import WorkerProcess
from tests.e2e.helpers import Stack, auth, new_conversation, sse, stored_reply

pytestmark = pytest.mark.integration


async def test_a_worker_killed_mid_reply_restarts_the_stream_without_repeats(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    headers = await auth(stack)
    conversation = await new_conversation(http, headers, stack.crash)
    first = WorkerProcess(stack.crash, stack.logs, stack.env)
    second = WorkerProcess(stack.crash, stack.logs, stack.env)
    first.start()
    try:
        await first.wait_ready()
        path = f"/v1/conversations/{conversation}/messages"
        body = {"content": "Tell me a story.", "max_tokens": 120, "ignore_eos": True}
        events: list[Any] = []
        async with http.stream("POST", path, json=body, headers=headers) as response:
            assert response.status_code == 200, await response.aread()
            async for _, data in sse(response):
                events.append(data)
                if data != "[DONE]" and data["type"] == "token" and len(events) == 4:
                    first.kill()  # mid-reply: the prompt is not committed, so it is rerun
                    second.start()
            await second.wait_ready()
    finally:
        first.kill()
        await asyncio.to_thread(second.terminate)

    kinds = [e if e == "[DONE]" else e["type"] for e in events]
    restart = kinds.index("restart")
    assert kinds[:4] == ["start", "token", "token", "token"]
    assert kinds.count("restart") == 1 and events[restart]["attempt"] == 2
    assert kinds[-2:] == ["final", "[DONE]"]
    assert all(e["attempt"] == 1 for e in events[1:restart])
    after = events[restart + 1 : -2]
    assert after and all(e["type"] == "token" and e["attempt"] == 2 for e in after)
    final = events[-2]
    assert final["attempt"] == 2 and final["finish_reason"] == "length"
    assert final["usage"]["completion_tokens"] == 120

    stored = await stored_reply(http, headers, conversation)
    replies = [m for m in stored if m["role"] == "assistant"]
    assert len(replies) == 1, "one reply, not one per attempt"
    assert replies[0]["attempt"] == 2 and replies[0]["status"] == "complete"
    assert replies[0]["content"] == "".join(e["delta"] for e in after)
