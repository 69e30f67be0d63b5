"""A replica whose token fan-out owns no partition (its consumer group re-forming after
a rebalance) cannot route a reply: a post is a 503 with Retry-After within the Kafka
timeout, nothing stored, where it waited without headers, holding its stream slot."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from infra.idle_worker import idle_worker
from schemas.events import PromptRequest
from tandoor.clients import redis_client
from tandoor.policies.redis_keys import cancel_key
from tandoor.settings import Settings
from tests.integration.test_gateway_conversations import client, user_key
from tests.waiting import eventually

pytestmark = pytest.mark.integration

__all__ = ["client"]  # the gateway in-process, shared with the conversations tests


async def posted_with_a_worker(
    client: httpx.AsyncClient, settings: Settings, conversation: str, auth: dict[str, str]
) -> httpx.Response:
    """A message posted once the gateway sees a worker (one that takes no prompt)."""
    services = client._transport.app.state.services  # type: ignore[attr-defined]
    model = settings.served_models[0]
    async with idle_worker(settings, model):

        async def served() -> int:
            return getattr(services.load.load(model), "workers", 0)

        await eventually(served, what="the gateway to see a worker")
        path = f"/v1/conversations/{conversation}/messages"
        return await client.post(path, json={"content": "Hello there"}, headers=auth)


async def test_a_post_while_no_partition_routes_replies_is_a_503(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch, settings: Settings
) -> None:
    auth = await user_key(settings)
    conversation = (await client.post("/v1/conversations", json={}, headers=auth)).json()["id"]
    services = client._transport.app.state.services  # type: ignore[attr-defined]
    monkeypatch.setattr(services.chat.deps.fanout, "_ready", asyncio.Event())  # revoked
    async with asyncio.timeout(240):  # it waited for ever: fail, not hang
        posted = await posted_with_a_worker(client, settings, conversation, auth)
    assert posted.status_code == 503, posted.text
    assert posted.headers["Retry-After"] and "routed" in posted.json()["error"]["message"]
    opened = (await client.get(f"/v1/conversations/{conversation}", headers=auth)).json()
    assert opened["messages"] == []


async def test_a_prompt_whose_send_timed_out_is_stopped_if_it_reached_kafka(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch, settings: Settings
) -> None:
    """Kafka took the prompt and acknowledged it late: the client was told its message
    failed, and the prompt only marked done, which a worker that had taken it already
    never reads: it answered a message shown as failed. It is cancelled too."""
    auth = await user_key(settings)
    conversation = (await client.post("/v1/conversations", json={}, headers=auth)).json()["id"]
    services = client._transport.app.state.services  # type: ignore[attr-defined]
    submitter, sent = services.chat.deps.submitter, []
    real_submit = submitter.submit

    async def acknowledged_late(prompt: PromptRequest, affinity: str | None = None) -> None:
        await real_submit(prompt, affinity)
        sent.append(prompt.request_id)
        await asyncio.Event().wait()  # its acknowledgement never comes in time

    monkeypatch.setattr(submitter, "submit", acknowledged_late)
    posted = await posted_with_a_worker(client, settings, conversation, auth)
    assert posted.status_code == 503 and "saved as failed" in posted.text, posted.text
    redis = redis_client(settings)
    try:
        cancelled = await eventually(
            lambda: redis.exists(cancel_key(sent[0])), what="the prompt cancelled"
        )
    finally:
        await redis.aclose()
    assert cancelled == 1
