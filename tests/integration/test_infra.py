"""The local-stack commands, run the way a person runs them."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

from infra.errors import StartError
from infra.redis_server import RedisServer
from infra.roles import GatewayProcess
from tandoor.settings import Settings


def tandoor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["tandoor", *args], capture_output=True, text=True, timeout=120)


def test_status_reports_every_server_ready(kafka: str, cassandra: Settings) -> None:
    result = tandoor("infra", "status")
    assert result.returncode == 0, result.stdout + result.stderr
    for name in ("kafka", "cassandra", "redis"):
        assert any(
            line.startswith(name) and " ready " in line for line in result.stdout.splitlines()
        )
    assert "stack healthy" in result.stdout


def test_up_and_bootstrap_again_change_nothing(kafka: str, cassandra: Settings) -> None:
    before = tandoor("infra", "status").stdout
    result = tandoor("infra", "up")
    assert result.returncode == 0, result.stderr
    assert "topics created -, grown -" in result.stdout
    assert "migrations applied -" in result.stdout
    assert tandoor("infra", "status").stdout == before  # same processes, same pids


def test_a_taken_port_is_reported_not_fought_over(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = RedisServer(Settings(home=tmp_path, redis_port=port))
        with pytest.raises(StartError, match=f"port 127.0.0.1:{port} is taken"):
            server.launch()


def test_a_server_that_fails_to_start_shows_its_log(tmp_path: Path) -> None:
    # A port settings refuse (copied past validation): Redis itself refuses it at start.
    settings = Settings(home=tmp_path, start_timeout_s=20).model_copy(update={"redis_port": 70000})
    server = RedisServer(settings)
    server.launch()
    with pytest.raises(StartError, match="exited during start-up") as info:
        server.wait_ready()
    assert "port" in str(info.value).lower()
    assert str(server.process.log_file) in str(info.value)


async def test_a_gateway_whose_port_is_taken_is_not_reported_ready(
    kafka: str, cassandra: Settings, redis_url: str, tmp_path: Path
) -> None:
    """uvicorn logs its start-up complete before it binds the port: the main job said
    "Tandoor is up" while the gateway had exited and the page's port was another's."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        gateway = GatewayProcess(tmp_path, taken.getsockname()[1], {})
        gateway.start()
        try:
            with pytest.raises(StartError, match="exited during start-up") as info:
                await gateway.wait_ready()
            assert "address already in use" in str(info.value)
        finally:
            gateway.terminate()
