"""Load shedding: while the `big` model is backlogged, the free tier is answered by
the stack's main model instead, and the reply says so."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from schemas.events import ANSWERED
from tests.e2e.helpers import auth, new_conversation, sse, stored_reply
from tests.e2e.stack import SHED_BACKLOG, Stack
from tests.ops import samples
from tests.waiting import eventually

pytestmark = pytest.mark.integration


async def start_event(
    http: httpx.AsyncClient, headers: dict[str, str], conversation: str
) -> dict[str, Any]:
    """Post a message and read only the start event: nobody serves `big`, so the
    prompt stays queued after the client has gone (closing the tab is not stop)."""
    path = f"/v1/conversations/{conversation}/messages"
    body = {"content": "Name a colour.", "max_tokens": 8}
    async with http.stream("POST", path, json=body, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        async for _, data in sse(response):
            assert data["type"] == "start"
            return dict(data)
    raise AssertionError("no start event")


async def wait_for_backlog(stack: Stack, at_least: int) -> None:
    """Until every replica has measured the backlog of `big` (its shedding signal)."""

    async def measured() -> list[float]:
        found = [await samples(g, model=stack.big) for g in stack.gateways]
        return [s.get("tandoor_gateway_model_backlog", -1) for s in found]

    await eventually(
        measured,
        lambda backlogs: min(backlogs) >= at_least,
        what=f"a backlog of {at_least} on {stack.big} at every replica",
    )


async def test_the_free_tier_falls_back_while_the_big_model_is_backlogged(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    paid, free = await auth(stack, "plus"), await auth(stack, "free")
    for _ in range(SHED_BACKLOG):
        waiting = await new_conversation(http, paid, stack.big)
        assert (await start_event(http, paid, waiting))["model"] == stack.big
    await wait_for_backlog(stack, SHED_BACKLOG)

    paid_chat = await new_conversation(http, paid, stack.big)
    assert (await start_event(http, paid, paid_chat))["model"] == stack.big, "paid: no shedding"

    conversation = await new_conversation(http, free, stack.big)
    path = f"/v1/conversations/{conversation}/messages"
    body = {"content": "What is 2 + 2?", "max_tokens": 16, "temperature": 0}
    async with http.stream("POST", path, json=body, headers=free) as response:
        assert response.status_code == 200, await response.aread()
        events = [data async for _, data in sse(response)]
    assert events[0]["model"] == stack.model
    final = events[-2]
    assert final["type"] == "final" and final["model"] == stack.model
    assert final["finish_reason"] in ANSWERED and final["usage"]["completion_tokens"]
    reply = (await stored_reply(http, free, conversation))[-1]
    assert reply["model"] == stack.model and reply["status"] == "complete"
