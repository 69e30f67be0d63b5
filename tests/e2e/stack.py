"""The whole stack the end-to-end tests run against, started once for the package: two
gateway replicas, a worker with the bundled model, the persistence consumer, over the
test command's Kafka, Cassandra and Redis. The fault tests kill and replace its roles,
and stop and bring back those servers with the same data."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx

from infra.cassandra_server import CassandraServer
from infra.kafka_server import KafkaServer
from infra.redis_server import RedisServer
from infra.roles import (
    AdmissionProcess,
    GatewayProcess,
    PersistProcess,
    RoleProcess,
    WorkerProcess,
    terminate_all,
)
from infra.server import LocalServer
from infra.stack import Stack as LocalServers
from tandoor.policies.api_keys import create_key
from tandoor.settings import Settings
from tests.waiting import eventually

SERVERS: dict[str, Callable[[Settings], LocalServer]] = {
    "kafka": KafkaServer,
    "cassandra": CassandraServer,
    "redis": RedisServer,
}
Role = TypeVar("Role", bound=RoleProcess)


SHED_BACKLOG = 2  # prompts waiting on the `big` model before the free tier is shed
BLOCKED_TERM = "zorblax"  # on the stack's moderation blocklist


@dataclass
class Stack:
    settings: Settings
    env: dict[str, str]  # what makes a role serve this stack's models
    logs: Path
    model: str  # served by the stack's worker
    big: str  # an idle worker (takes nothing): prompts wait; the free tier falls back
    idle: str  # no worker at all: busy at once; the free tier falls back to `model`
    second: str  # another real model (Gemma 3); the free tier falls back to `model`
    worker: WorkerProcess
    second_worker: WorkerProcess
    persist: PersistProcess
    admission: AdmissionProcess
    gateways: list[GatewayProcess]
    retired: list[RoleProcess] = field(default_factory=list)  # killed, kept for their logs

    @property
    def url(self) -> str:
        """The first replica's (a replaced replica keeps its port)."""
        return self.urls[0]

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{g.port}" for g in self.gateways]

    def roles(self) -> list[RoleProcess]:
        return [self.worker, self.second_worker, self.persist, self.admission, *self.gateways]

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        for role in self.roles():
            role.start()
        try:
            await asyncio.gather(*(role.wait_ready() for role in self.roles()))
            yield
        finally:
            await terminate_all(self.roles(), 30)

    async def replace_worker(self) -> WorkerProcess:
        """kill -9 the worker (its engine too) and start a new one."""
        self.worker = await self._replace(
            self.worker, WorkerProcess(self.model, self.logs, self.env)
        )
        return self.worker

    async def replace_persist(self) -> PersistProcess:
        self.persist = await self._replace(self.persist, PersistProcess(self.logs, self.env))
        return self.persist

    async def replace_gateway(self, index: int) -> GatewayProcess:
        """kill -9 one replica and start it again on the same port."""
        old = self.gateways[index]
        self.gateways[index] = await self._replace(
            old, GatewayProcess(self.logs, old.port, self.env)
        )
        return self.gateways[index]

    async def _replace(self, old: RoleProcess, new: Role) -> Role:
        old.kill()
        self.retired.append(old)
        new.start()
        await new.wait_ready()
        return new

    async def usable(self) -> None:
        """Until every replica serves a request that needs Cassandra and Redis again."""
        key, _ = await create_key(self.settings, f"probe-{uuid.uuid4().hex[:6]}", "plus")
        headers = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(timeout=10) as http:
            for url in self.urls:
                await eventually(
                    lambda: _answers(http, f"{url}/v1/conversations", headers),  # noqa: B023
                    what=f"{url} serving again",
                )

    async def revive(self) -> None:
        """Start again any role that died: a failed test must not sink the next one. Its
        log is kept beside the new one (start() truncates it) and its end printed."""
        for role in self.roles():
            if role.proc is not None and role.proc.poll() is not None:
                kept = role.log_file.with_name(f"{role.log_file.stem}.died.log")
                role.log_file.replace(kept)
                tail = kept.read_text(errors="replace")[-3000:]
                print(f"{role.name} had died (exit {role.proc.returncode}), revived:\n{tail}")
                role.start()
                await role.wait_ready()


async def _answers(http: httpx.AsyncClient, url: str, headers: dict[str, str]) -> bool:
    try:
        return (await http.get(url, headers=headers)).status_code == 200
    except httpx.TransportError:
        return False


def server(settings: Settings, name: str) -> LocalServer:
    return SERVERS[name](settings)


async def stop_server(settings: Settings, name: str) -> None:
    """SIGTERM (SIGKILL after the grace period); its data stays where it is."""
    stopped = await asyncio.to_thread(server(settings, name).stop)
    assert stopped, f"{name} was not running"


async def servers_back(settings: Settings) -> None:
    """`tandoor infra up` in a child process (the servers it starts are not ours to
    reap): starts whatever is stopped, on the same data, and waits until it is ready."""
    if await asyncio.to_thread(LocalServers(settings).healthy):
        return
    argv = [sys.executable, "-m", "tandoor", "infra", "up", "--skip-bootstrap"]
    await asyncio.to_thread(subprocess.run, argv, check=True, capture_output=True, timeout=240)
