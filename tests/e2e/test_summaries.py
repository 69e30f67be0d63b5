"""A conversation longer than the model's context: once older turns stop fitting, a
background job summarizes them, and later prompts carry the summary in their place."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest

from infra.process import free_port
from infra.roles import GatewayProcess, running, with_models
from schemas.events import ANSWERED
from tests.e2e.helpers import auth, new_conversation, sse
from tests.e2e.stack import Stack
from tests.waiting import eventually

pytestmark = pytest.mark.integration
TOPICS = ["volcanoes", "glaciers", "deserts", "rainforests"]


async def post(
    http: httpx.AsyncClient, headers: dict[str, str], conversation: str, text: str
) -> list[Any]:
    path = f"/v1/conversations/{conversation}/messages"
    body = {"content": text, "max_tokens": 16, "temperature": 0}
    async with http.stream("POST", path, json=body, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        return [data async for _, data in sse(response)]


async def test_older_turns_are_summarized_and_used(stack: Stack) -> None:
    # A replica that budgets a small window: a few turns fill it.
    env = {
        **with_models(stack.env, max_model_len=400),
        "TANDOOR_GATEWAY_GROUP": f"gateway-summary-{uuid.uuid4().hex[:6]}",
    }
    gateway = GatewayProcess(stack.logs, free_port(), env)
    headers = await auth(stack)
    async with (
        running([gateway]),
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.port}", timeout=120) as http,
    ):
        conversation = await new_conversation(http, headers)
        for topic in TOPICS:  # about 135 tokens a turn: the third no longer fits them all
            question = f"Tell me about {topic}. " + "Please be detailed. " * 25
            assert (await post(http, headers, conversation, question))[-2]["type"] == "final"

        async def opened_conversation() -> dict[str, Any]:
            opened = await http.get(f"/v1/conversations/{conversation}", headers=headers)
            return dict(opened.json())

        # The summary job runs in the batch band.
        opened = await eventually(
            opened_conversation, lambda c: c["summary"], what=f"a summary of {conversation}"
        )
        assert opened["summary"] and opened["summary_until"], "no summary was made"
        later = await post(http, headers, conversation, "Which topic did we start with?")
        assert later[0]["type"] == "start" and later[0]["summarized"] is True

        # Editing a summarized turn (to take something out of it) forgets the summary:
        # neither shown nor sent to the model any more.
        first = next(m for m in opened["messages"] if m["role"] == "user")
        edit = f"/v1/conversations/{conversation}/messages/{first['id']}/edit"
        # An edit refused (too long for the window) leaves it as it was, summary included
        # (it was forgotten before the refusal).
        refused = await http.post(edit, json={"content": "word " * 6000}, headers=headers)
        assert refused.status_code == 413, refused.text
        unchanged = await opened_conversation()  # (a later turn may have summarized anew)
        assert unchanged["summary"] and unchanged["summary_until"], unchanged
        body = {"content": "Tell me about rivers.", "max_tokens": 16, "temperature": 0}
        async with http.stream("POST", edit, json=body, headers=headers) as response:
            assert response.status_code == 200, await response.aread()
            assert [d async for _, d in sse(response)][-2]["type"] == "final"
        edited = await opened_conversation()
        assert edited["summary"] is None and edited["summary_until"] is None, edited
        after = await post(http, headers, conversation, "Which topic did we start with?")
    assert after[0]["type"] == "start" and after[0]["summarized"] is False
    assert later[-2]["type"] == "final" and later[-2]["finish_reason"] in ANSWERED
