"""The test command's environment (scripts/test_env.sh) against a developer's shell.
It kept an exported TANDOOR_HOME (a documented setting) and ports: the test servers
were the development stack's, found running and taken as started, and the test
command's teardown (`tandoor infra down`) stopped them under the developer's stack."""

from __future__ import annotations

import os
import subprocess

from tandoor import PROJECT_ROOT

DEVELOPMENT = {
    "TANDOOR_HOME": "/srv/tandoor-dev",
    "TANDOOR_KAFKA_PORT": "9092",
    "TANDOOR_KAFKA_CONTROLLER_PORT": "9093",
    "TANDOOR_CASSANDRA_PORT": "9042",
    "TANDOOR_CASSANDRA_STORAGE_PORT": "7000",
    "TANDOOR_REDIS_PORT": "6379",
}


def sourced_env(environment: dict[str, str]) -> dict[str, str]:
    shown = subprocess.run(
        ["bash", "-c", "source scripts/test_env.sh && env"],
        cwd=PROJECT_ROOT,
        env={**os.environ, **environment},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    pairs = (line.partition("=") for line in shown.splitlines())
    return {name: value for name, _, value in pairs if name in DEVELOPMENT}


def test_the_test_servers_never_take_a_development_stacks_home_or_ports() -> None:
    tested = sourced_env(DEVELOPMENT)
    assert tested["TANDOOR_HOME"] == str(PROJECT_ROOT / ".tandoor" / "test")
    for name, development in DEVELOPMENT.items():
        assert tested[name] != development, name
    assert tested == sourced_env({}), "the same whatever the shell exports"
