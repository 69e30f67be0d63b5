"""A gateway replica of a security test module's own, which remembers every key the
module creates (valid, revoked, never created) and checks, after the module, that none
of them was logged."""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from infra.process import free_port
from infra.roles import GatewayProcess, running, with_models
from tandoor.clients import cassandra_session, redis_client
from tandoor.policies.api_keys import KeyStore
from tests.e2e.stack import Stack


@dataclass
class Guarded:
    """This module's gateway replica, and every key the module used."""

    url: str
    gateway: GatewayProcess
    keys: KeyStore
    secrets: list[str] = field(default_factory=list)
    never_created: set[str] = field(default_factory=set)

    async def user(self, tier: str = "plus") -> dict[str, str]:
        key, _ = await self.keys.create(f"sec-{uuid.uuid4().hex[:8]}", tier)
        self.secrets.append(key)
        return {"Authorization": f"Bearer {key}"}

    async def revoked(self) -> str:
        key, _ = await self.keys.create(f"sec-revoked-{uuid.uuid4().hex[:8]}", "plus")
        self.secrets.append(key)
        assert await self.keys.resolve(key) is not None  # cached as valid first
        await self.keys.revoke(key)
        return key

    def unknown(self) -> str:
        key = "tdr_" + secrets.token_urlsafe(32)
        self.secrets.append(key)
        self.never_created.add(key)
        return key


def sha256(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def found_in_logs(folder: Path, keys: list[str]) -> list[str]:
    """'<log file>: key|hash' for each key, or its SHA-256, found in a log under folder."""
    found = []
    for log in (p for p in folder.rglob("*") if p.is_file()):
        text = log.read_text(errors="replace")
        found += [f"{log.name}: key" for key in keys if key in text]
        found += [f"{log.name}: hash" for key in keys if sha256(key) in text]
    return found


@pytest.fixture(scope="module")
async def guarded(stack: Stack) -> AsyncIterator[Guarded]:
    """Once the module is done and the replica has stopped (its log complete), no key the
    module used, nor its SHA-256, may be in any log of the stack."""
    env = {
        **with_models(stack.env, only=[stack.model]),
        "TANDOOR_FALLBACKS": "{}",
        "TANDOOR_GATEWAY_GROUP": f"gateway-sec-{uuid.uuid4().hex[:6]}",
    }
    gateway = GatewayProcess(stack.logs, free_port(), env)
    settings = stack.settings
    cache = redis_client(settings)
    try:
        with cassandra_session(settings, settings.keyspace) as session:
            async with running([gateway]):
                keys = KeyStore(session, cache, set(settings.tiers))
                used = Guarded(f"http://127.0.0.1:{gateway.port}", gateway, keys)
                yield used
    finally:
        await cache.aclose()
    assert gateway.log_file.is_relative_to(stack.logs)  # its log is read too
    assert await asyncio.to_thread(found_in_logs, stack.logs, used.secrets) == []


async def owned_conversation(http: httpx.AsyncClient, headers: dict[str, str]) -> str:
    response = await http.post("/v1/conversations", json={"title": "mine"}, headers=headers)
    assert response.status_code == 201, response.text
    return str(response.json()["id"])
