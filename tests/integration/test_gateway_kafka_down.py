"""Kafka unreachable: the client gets a 503 within seconds and its message is kept as
failed, not lost. Stops and restarts the test Kafka, so it runs on its own."""

from __future__ import annotations

import asyncio
import subprocess
import time
import uuid
from collections.abc import AsyncIterator

import httpx
import pytest

from infra.idle_worker import idle_worker
from infra.kafka_server import KafkaServer
from producers.gateway.app import create_app
from tandoor.policies.api_keys import create_key
from tandoor.settings import Settings

pytestmark = pytest.mark.integration


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


async def test_kafka_down_is_a_503_and_the_message_is_kept_as_failed(
    kafka_down: KafkaServer, cassandra: Settings, redis_url: str
) -> None:
    app = create_app(cassandra.model_copy(update={"gateway_group": f"gw-{uuid.uuid4().hex}"}))
    key, _ = await create_key(cassandra, f"user-{uuid.uuid4().hex[:8]}", "plus")
    headers = {"Authorization": f"Bearer {key}"}
    async with idle_worker(cassandra, cassandra.served_models[0]), app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            created = await http.post("/v1/conversations", json={}, headers=headers)
            conversation = created.json()["id"]
            await asyncio.to_thread(kafka_down.stop)
            started = time.monotonic()
            response = await http.post(
                f"/v1/conversations/{conversation}/messages",
                json={"content": "Are you there?"},
                headers=headers,
            )
            elapsed = time.monotonic() - started
            opened = (await http.get(f"/v1/conversations/{conversation}", headers=headers)).json()
            await restart_stack()
    assert response.status_code == 503 and elapsed < 10, (response.status_code, elapsed)
    assert response.json()["error"]["type"] == "service_unavailable"
    assert [(m["content"], m["status"]) for m in opened["messages"]] == [
        ("Are you there?", "failed")
    ]
