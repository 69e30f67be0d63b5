"""Operating the roles: metrics, health and readiness on each role's ops port, request
ids followed through the JSON logs, and a gateway that drains at SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from infra.process import free_port
from infra.roles import GatewayProcess, RoleProcess, running
from schemas.events import ANSWERED
from tests.e2e.helpers import auth, chat, new_conversation, reply_text, sse, stored_reply
from tests.e2e.stack import Stack
from tests.ops import ops_get, samples
from tests.waiting import until

pytestmark = pytest.mark.integration


async def status_once_draining(gateway: GatewayProcess) -> int:
    """/ready, polled from the moment the signal is sent until it says 503 or the gateway
    has exited (the loop takes the signal within milliseconds; a fixed sleep raced the
    reply's end)."""
    assert gateway.proc is not None
    while gateway.proc.poll() is None:
        with contextlib.suppress(httpx.TransportError):  # it may exit while asked
            if (status := (await ops_get(gateway, "/ready")).status_code) == 503:
                return status
        await asyncio.sleep(0.02)
    return 0  # exited without ever saying it drains


def roles_of(stack: Stack) -> list[RoleProcess]:
    return [*stack.gateways, stack.worker, stack.persist]


async def test_every_role_is_healthy_ready_and_counts_what_it_did(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    headers = await auth(stack)
    conversation = await new_conversation(http, headers)
    # The stack is the module's: earlier tests' counts are in, so the increase is read.
    before = {id(role): await samples(role) for role in roles_of(stack)}  # two "gateway"s
    events = await chat(http, headers, conversation, "Name a colour.", max_tokens=8)
    await stored_reply(http, headers, conversation)
    for role in roles_of(stack):
        assert (await ops_get(role, "/health")).json()["status"] == "ok"
        ready = await ops_get(role, "/ready")
        assert ready.status_code == 200, (role.name, ready.text)
        assert all(ready.json()["checks"].values()), ready.json()
    assert (await http.get("/ready")).json()["status"] == "ready"  # the gateway's own port

    async def grown(role: RoleProcess) -> Callable[[str], float]:
        after, earlier = await samples(role), before[id(role)]
        return lambda name: after[name] - earlier.get(name, 0.0)

    gateway = await grown(stack.gateways[0])
    assert gateway("tandoor_gateway_http_requests_total") >= 2  # the post, the read back
    assert "tandoor_gateway_open_streams" in await samples(stack.gateways[0])
    worker = await grown(stack.worker)
    completion = events[-2]["usage"]["completion_tokens"]
    assert worker("tandoor_worker_generated_tokens_total") >= completion
    assert worker("tandoor_worker_requests_finished_total") >= 1
    persist = await grown(stack.persist)
    assert persist("tandoor_persist_replies_stored_total") >= 1
    assert persist("tandoor_persist_write_seconds_count") >= 1


def logged(role: RoleProcess) -> list[dict[str, Any]]:
    """The role's own JSON log lines (vLLM and the JVMs print their own formats)."""
    lines = []
    for line in role.log().splitlines():
        if line.startswith("{"):
            entry = json.loads(line)
            if "role" in entry:
                lines.append(entry)
    return lines


async def test_one_request_is_followed_through_gateway_worker_and_persist(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    headers = await auth(stack)
    conversation = await new_conversation(http, headers)
    events = await chat(http, headers, conversation, "Say hello.", max_tokens=8)
    request_id = events[0]["request_id"]
    await stored_reply(http, headers, conversation)
    # The worker logs after publishing its final: persist may log first.
    by_role = await until(
        lambda: lines_about(request_id, roles_of(stack)),
        lambda found: len(found) == 3,
        what=f"every role logging {request_id}",
    )
    assert set(by_role) == {"gateway", "worker", "persist"}, by_role
    assert any("queued chat prompt" in m for m in by_role["gateway"])
    assert any("attempt 1" in m and "completion tokens" in m for m in by_role["worker"])
    assert any(m.startswith("stored chat reply") for m in by_role["persist"])


def lines_about(request_id: str, roles: list[RoleProcess]) -> dict[str, list[str]]:
    """Each role's log messages about `request_id`."""
    by_role: dict[str, list[str]] = {}
    for role in roles:
        for entry in logged(role):
            if entry.get("request_id") == request_id:
                by_role.setdefault(entry["role"], []).append(entry["msg"])
    return by_role


@asynccontextmanager
async def spare_gateway(
    stack: Stack, **env: str
) -> AsyncIterator[tuple[GatewayProcess, httpx.AsyncClient]]:
    """A gateway of its own group, so its shutdown moves no partitions of the others."""
    env = {**stack.env, "TANDOOR_GATEWAY_GROUP": f"spare-{uuid.uuid4().hex[:8]}", **env}
    gateway = GatewayProcess(stack.logs, free_port(), env)
    async with running([gateway]):
        url = f"http://127.0.0.1:{gateway.port}"
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            yield gateway, client


async def exit_code(gateway: GatewayProcess) -> int:
    assert gateway.proc is not None
    return await asyncio.to_thread(gateway.proc.wait, 60)


async def test_sigterm_ends_chat_streams_and_they_resume_on_another_replica(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    headers = await auth(stack)
    conversation = await new_conversation(http, headers)
    # Long enough to still be running when the client comes back (as a client would,
    # at once), so the rest really comes from the other replica.
    body = {"content": "Write a very long story about a dragon.", "max_tokens": 160}
    seen: list[Any] = []
    ids: list[str] = []  # "reply.attempt.characters sent so far"
    last_id = None
    async with spare_gateway(stack) as (gateway, client):
        path = f"/v1/conversations/{conversation}/messages"
        async with client.stream("POST", path, json=body, headers=headers) as response:
            assert response.status_code == 200
            async for event_id, data in sse(response):
                last_id = event_id or last_id
                ids += [event_id] if event_id else []
                seen.append(data)
                if len(seen) == 4:
                    assert gateway.proc is not None
                    gateway.proc.send_signal(signal.SIGTERM)
        assert all(e["type"] != "final" for e in seen), "the stream ran to its end: no drain"
        resumed = {**headers, "Last-Event-ID": str(last_id)}
        path = f"/v1/conversations/{conversation}/stream"
        async with http.stream("GET", path, headers=resumed) as response:
            assert response.status_code == 200
            rest = []
            async for event_id, data in sse(response):
                ids += [event_id] if event_id else []
                rest.append(data)
        # uvicorn finishes its shutdown, then re-raises SIGTERM: the usual status.
        assert await exit_code(gateway) in (0, -signal.SIGTERM)
    assert rest[-2]["type"] == "final" and rest[-1] == "[DONE]"
    assert all(e["type"] != "restart" for e in rest if isinstance(e, dict))
    offsets = [int(i.split(".")[2]) for i in ids]
    assert offsets == sorted(offsets) and len(set(offsets[:-1])) == len(offsets) - 1  # no repeats
    stored = await stored_reply(http, headers, conversation)
    assert stored[1]["content"] == reply_text(seen) + reply_text(rest)


async def test_an_openai_stream_finishes_while_its_gateway_drains(stack: Stack) -> None:
    headers = await auth(stack)
    body = {
        "model": stack.model,
        # The prompt the other drain tests use: long on every CPU (a counting prompt
        # got a short answer on one, and ended before the probe).
        "messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
        "max_tokens": 200,  # the reply must outlast the probe below
        "temperature": 0,
        "stream": True,
    }
    readiness: list[int] = []
    chunks_at_probe = 0
    # A drain longer than any reply on any CPU: the reply must end by itself.
    async with spare_gateway(stack, TANDOOR_GATEWAY_DRAIN_S="3600") as (gateway, client):
        chunks: list[Any] = []
        async with client.stream(
            "POST", "/v1/chat/completions", json=body, headers=headers
        ) as response:
            async for _, data in sse(response):
                chunks.append(data)
                if len(chunks) == 2:
                    assert gateway.proc is not None
                    gateway.proc.send_signal(signal.SIGTERM)
                    readiness.append(await status_once_draining(gateway))
                    chunks_at_probe = len(chunks)
        assert await exit_code(gateway) in (0, -signal.SIGTERM)
    assert readiness == [503]  # draining: no new traffic, but this stream goes on
    assert len(chunks) > chunks_at_probe + 1, "the stream did not go on after the probe"
    assert chunks[-1] == "[DONE]"
    finish = [c["choices"][0]["finish_reason"] for c in chunks[:-1] if c["choices"]]
    assert finish[-1] in ANSWERED  # it ran to its end, not cut off
