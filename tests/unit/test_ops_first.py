"""Every role serves /health, /ready and /metrics before it connects to anything: a
Kubernetes liveness probe answered only once Cassandra, Kafka and a group join were done
(up to 45 s for the gateway), and restarted a pod that was still starting; a taken port
showed only after all of it."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from consumers.persist import Persister
from producers.admission.role import Admission
from producers.gateway.app import create_app
from tandoor.settings import Settings


class Connected(Exception):
    """A role reached its first connection."""


def connect(*args: Any, **kwargs: Any) -> Any:
    raise Connected


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


async def test_the_gateway_binds_its_ops_port_before_its_services(
    monkeypatch: pytest.MonkeyPatch, taken_port: int
) -> None:
    monkeypatch.setattr("producers.gateway.app.open_services", connect)
    app = create_app(Settings(gateway_metrics_port=taken_port))
    with pytest.raises(SystemExit, match=f"port {taken_port}"):
        async with app.router.lifespan_context(app):
            pass


async def test_persist_binds_its_ops_port_before_cassandra(
    monkeypatch: pytest.MonkeyPatch, taken_port: int
) -> None:
    monkeypatch.setattr("consumers.persist.cassandra_cluster", connect)
    persister = Persister(Settings(persist_metrics_port=taken_port))
    try:
        with pytest.raises(SystemExit, match=f"port {taken_port}"):
            await persister.start()
    finally:
        await persister.close()


async def test_persist_is_alive_and_not_ready_while_it_connects(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("consumers.persist.cassandra_cluster", connect)
    persister = Persister(Settings(persist_metrics_port=0))
    try:
        with pytest.raises(Connected):
            await persister.start()  # stuck there: what a probe sees meanwhile
        port = persister.ops._runner.addresses[0][1]  # type: ignore[union-attr]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as probe:
            assert (await probe.get("/health")).status_code == 200
            ready = await probe.get("/ready")
            assert ready.status_code == 503 and ready.json()["checks"]["cassandra"] is False
    finally:
        await persister.close()


async def test_admission_binds_its_ops_port_before_cassandra(
    monkeypatch: pytest.MonkeyPatch, taken_port: int
) -> None:
    monkeypatch.setattr("producers.admission.role.cassandra_cluster", connect)
    admission = Admission(Settings(admission_metrics_port=taken_port))
    try:
        with pytest.raises(SystemExit, match=f"port {taken_port}"):
            await admission.start()
    finally:
        await admission.ops.close()
        await admission.consumer.stop()
        await admission.producer.stop()
