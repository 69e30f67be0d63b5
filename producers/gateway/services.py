"""The gateway's connections, opened once in the app's lifespan and shared by routes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from producers.gateway.conversations.service import ConversationService
from producers.keys import KeyStore
from tandoor.clients import cassandra_cluster, redis_client
from tandoor.settings import Settings


@dataclass
class Services:
    settings: Settings
    keys: KeyStore
    conversations: ConversationService


@asynccontextmanager
async def open_services(settings: Settings) -> AsyncIterator[Services]:
    cluster = cassandra_cluster(settings)
    cache = redis_client(settings)
    try:
        session: Any = await asyncio.to_thread(cluster.connect, settings.keyspace)
        yield Services(
            settings=settings,
            keys=KeyStore(session, cache, set(settings.tiers)),
            conversations=ConversationService(session, settings.models),
        )
    finally:
        await cache.aclose()
        await asyncio.to_thread(cluster.shutdown)


def services(request: Request) -> Services:
    deps: Services = request.app.state.services
    return deps
