"""Kafka unreachable: the client gets a 503 within seconds and its message is kept as
failed, not lost. Stops and restarts the test Kafka, so it runs on its own."""

from __future__ import annotations

import asyncio
import subprocess
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from infra.idle_worker import idle_worker
from infra.kafka_server import KafkaServer
from infra.process import free_port
from infra.roles import GatewayProcess, running
from tandoor.policies.api_keys import create_key
from tandoor.settings import Settings

pytestmark = pytest.mark.integration

HANG_S = 30  # past the producer's own timeouts; the hang it guards against took 40 s


async def restart_stack() -> None:
    """`tandoor infra up` in a child process: the servers it starts are not ours to reap."""
    argv = ["tandoor", "infra", "up", "--skip-bootstrap"]
    await asyncio.to_thread(subprocess.run, argv, check=True, capture_output=True, timeout=180)


@pytest.fixture
async def kafka_down(kafka: str, settings: Settings) -> AsyncIterator[KafkaServer]:
    server = KafkaServer(settings)
    yield server
    if server.process.pid() is None:  # bring it back for the tests after this one
        await restart_stack()


async def start_reply(http: httpx.AsyncClient, headers: dict[str, str], conv: str) -> None:
    """Post a message and read its start event; the idle worker never takes the prompt,
    so the reply stays running (closing the stream is not stop)."""
    path = f"/v1/conversations/{conv}/messages"
    async with http.stream("POST", path, json={"content": "Wait"}, headers=headers) as running:
        assert running.status_code == 200, await running.aread()
        async for line in running.aiter_lines():
            if line.startswith("data: "):
                return
    raise AssertionError("no start event")


async def test_kafka_down_is_a_503_and_the_message_is_kept_as_failed(
    kafka_down: KafkaServer, cassandra: Settings, redis_url: str, tmp_path: Path
) -> None:
    """Also: a Stop then is a 503 within seconds (it hung 40 s, then a 500), and a
    regenerate finds no sent message to answer (the failed one is no question)."""
    env = {"TANDOOR_GATEWAY_GROUP": f"gw-{uuid.uuid4().hex}"}
    gateway = GatewayProcess(tmp_path, free_port(), env)
    key, _ = await create_key(cassandra, f"user-{uuid.uuid4().hex[:8]}", "plus")
    headers = {"Authorization": f"Bearer {key}"}
    async with idle_worker(cassandra, cassandra.served_models[0]), running([gateway]):
        url = f"http://127.0.0.1:{gateway.port}"
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            conversation, waiting = [
                (await http.post("/v1/conversations", json={}, headers=headers)).json()["id"]
                for _ in range(2)
            ]
            await start_reply(http, headers, waiting)
            await asyncio.to_thread(kafka_down.stop)
            # A hang (40 s, then a 500) is the client's timeout here, not a measured time.
            response = await http.post(
                f"/v1/conversations/{conversation}/messages",
                json={"content": "Are you there?"},
                headers=headers,
                timeout=HANG_S,
            )
            opened = await http.get(f"/v1/conversations/{conversation}", headers=headers)
            regenerated = await http.post(
                f"/v1/conversations/{conversation}/regenerate", json={}, headers=headers
            )
            stopped = await http.post(
                f"/v1/conversations/{waiting}/stop", headers=headers, timeout=HANG_S
            )
            asked = {
                "model": cassandra.served_models[0],
                "messages": [{"role": "user", "content": "Hi"}],
            }
            completion = await http.post("/v1/chat/completions", json=asked, headers=headers)
            listed = (await http.get("/v1/conversations", headers=headers)).json()["data"]
            await restart_stack()
    assert response.status_code == 503, response.text
    assert response.json()["error"]["type"] == "service_unavailable"
    assert [(m["content"], m["status"]) for m in opened.json()["messages"]] == [
        ("Are you there?", "failed")
    ]
    assert regenerated.status_code == 409, regenerated.text
    assert stopped.status_code == 503, stopped.text
    assert "Retry-After" in stopped.headers
    # An API call's conversation, opened for it alone, is not left behind (each of the
    # SDK's retries left one, titled with the prompt, holding a failed message).
    assert completion.status_code == 503 and "nothing was kept" in completion.text
    # Refused after its admission: tagged with the id its logs name, as the SDK reads it.
    assert completion.headers.get("X-Request-Id", "").startswith("r_"), completion.headers
    assert sorted(c["id"] for c in listed) == sorted([conversation, waiting])
