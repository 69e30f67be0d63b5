"""When a model is busy: while `big` is backlogged the free tier is answered by the
stack's main model instead, and the reply says so; a prompt no worker can start within
its tier's wait budget is refused at once (a 503 with Retry-After), on every surface."""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import openai
import pytest

from infra.process import free_port
from infra.roles import GatewayProcess, running, with_models
from schemas.events import ANSWERED
from tests.e2e.helpers import auth, chat, new_conversation, sse, stored_reply
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


async def test_a_model_no_worker_serves_is_refused_at_once_on_every_surface(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    """A 503 naming the model, with Retry-After, instead of a stream that waits until its
    prompt expires; nothing stored, no quota spent. The free tier gets the fallback."""
    tight = await auth(stack, "tight")  # two requests a minute
    conversation = await new_conversation(http, tight, stack.idle)
    path = f"/v1/conversations/{conversation}/messages"
    for _ in range(3):
        refused = await http.post(path, json={"content": "Anyone there?"}, headers=tight)
        assert refused.status_code == 503, refused.text
        assert int(refused.headers["Retry-After"]) >= 1
        error = refused.json()["error"]
        assert error["type"] == "service_unavailable" and stack.idle in error["message"]
        assert "no worker" in error["message"]
    opened = (await http.get(f"/v1/conversations/{conversation}", headers=tight)).json()
    assert opened["messages"] == [], "a refused message is not kept"

    api = openai.AsyncOpenAI(
        api_key=tight["Authorization"].removeprefix("Bearer "),
        base_url=f"{stack.url}/v1",
        max_retries=0,
    )
    async with api:
        with pytest.raises(openai.InternalServerError) as caught:
            await api.chat.completions.create(
                model=stack.idle, messages=[{"role": "user", "content": "Anyone there?"}]
            )
    assert caught.value.status_code == 503 and stack.idle in caught.value.message
    assert caught.value.response.headers["Retry-After"]
    for _ in range(2):  # the refusals spent none of the minute's two requests
        served = await chat(http, tight, await new_conversation(http, tight), "Hi.", 2)
        assert served[-2]["type"] == "final", served

    free = await auth(stack, "free")
    fallen_back = await new_conversation(http, free, stack.idle)
    events = await chat(http, free, fallen_back, "Say hi.", max_tokens=4)
    assert events[0]["model"] == stack.model and events[-2]["type"] == "final"


async def test_a_backlog_nobody_works_off_is_refused_once_past_the_wait_budget(
    stack: Stack,
) -> None:
    """One slot per worker and a 2 s budget: prompts on `big` (its worker takes nothing)
    are taken while a slot is free, then refused at once instead of queued to expire."""
    tiers = json.loads(stack.env["TANDOOR_TIERS"])
    tiers["plus"]["max_wait_s"] = 2
    env = {
        **with_models(stack.env, max_num_seqs=1),
        "TANDOOR_GATEWAY_GROUP": f"gateway-busy-{uuid.uuid4().hex[:6]}",
        "TANDOOR_TIERS": json.dumps(tiers),
    }
    gateway = GatewayProcess(stack.logs, free_port(), env)
    headers = await auth(stack, "plus")
    async with (
        running([gateway]),
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.port}", timeout=60) as http,
    ):

        async def post() -> int:
            """200 (taken, left waiting) or the refusal's status."""
            conversation = await new_conversation(http, headers, stack.big)
            path = f"/v1/conversations/{conversation}/messages"
            async with http.stream("POST", path, json={"content": "Hi?"}, headers=headers) as r:
                if r.status_code == 503:
                    body = json.loads(await r.aread())
                    assert "none finished" in body["error"]["message"], body
                    assert r.headers["Retry-After"]
                return r.status_code

        statuses = [await post()]
        statuses += [await eventually(post, lambda status: status == 503, what="a refusal")]
    assert set(statuses) <= {200, 503} and statuses[-1] == 503, statuses
