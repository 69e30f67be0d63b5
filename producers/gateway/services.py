"""The gateway's connections, opened once in the app's lifespan and shared by routes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

from fastapi import Request

from consumers.fanout import TokenFanout
from producers.gateway.batches.service import BatchService
from producers.gateway.chat.checks import ReplyChecks
from producers.gateway.chat.jobs import ConversationJobs
from producers.gateway.chat.keeper import keep_records
from producers.gateway.chat.service import ChatDeps, ChatService
from producers.gateway.conversations.service import ConversationService
from producers.gateway.shedding import ModelRouter
from producers.gateway.streaming import StreamSlots
from producers.model_load import LoadMonitor
from producers.prompts import PromptSubmitter
from tandoor.background import Background
from tandoor.clients import (
    REDIS_DOWN,
    cassandra_cluster,
    kafka_producer,
    redis_client,
    transactional_producer,
)
from tandoor.policies.api_keys import KeyStore
from tandoor.policies.moderation import DefaultModerator
from tandoor.policies.quota import Quotas
from tandoor.settings import Settings

# Checks shown on /ready that do not make the gateway unready: without Redis the paid
# tiers are still served (docs/architecture.md, "When Redis is down"), and a probe that
# failed on it took every replica out of the load balancer.
READY_WITHOUT = frozenset({"redis"})
REDIS_CHECK_S = 1.0  # under tandoor.ops.CHECK_TIMEOUT_S: a frozen Redis is named, not a hang


@dataclass
class Services:
    settings: Settings
    keys: KeyStore
    conversations: ConversationService
    chat: ChatService
    cluster: Any  # the Cassandra cluster, for readiness
    session: Any  # its session, for reads of no one service (the usage page)
    load: LoadMonitor
    batches: BatchService

    async def readiness(self) -> dict[str, bool]:
        deps = self.chat.deps
        return {
            "redis": await _answers(deps.redis),
            "cassandra": any(host.is_up for host in self.cluster.metadata.all_hosts()),
            "kafka": deps.fanout.ready,
            "accepting": not deps.streams.draining.is_set(),
        }


async def _answers(redis: Any) -> bool:
    try:
        return bool(await asyncio.wait_for(redis.ping(), REDIS_CHECK_S))
    except (TimeoutError, *REDIS_DOWN):
        return False


@asynccontextmanager
async def open_services(settings: Settings, slots: StreamSlots) -> AsyncIterator[Services]:
    async with AsyncExitStack() as stack:
        cluster = cassandra_cluster(settings)
        stack.push_async_callback(asyncio.to_thread, cluster.shutdown)
        session: Any = await asyncio.to_thread(cluster.connect, settings.keyspace)
        cache = redis_client(settings)
        stack.push_async_callback(cache.aclose)
        producer = await stack.enter_async_context(kafka_producer(settings, "gateway"))
        fanout = TokenFanout(settings)
        await fanout.start()
        stack.push_async_callback(fanout.stop)
        load = LoadMonitor(settings)
        await load.start()
        stack.push_async_callback(load.stop)
        conversations = ConversationService(session, settings.served_models)
        submitter = PromptSubmitter(settings, producer)
        quotas, moderator = Quotas(cache), DefaultModerator(settings.moderation_blocklist)
        checks = ReplyChecks(settings, moderator, quotas)
        jobs = ConversationJobs(fanout, submitter, conversations, cache, checks)
        stack.push_async_callback(jobs.stop)
        chat = ChatService(
            ChatDeps(
                settings=settings,
                conversations=conversations,
                fanout=fanout,
                producer=producer,
                submitter=submitter,
                redis=cache,
                quotas=quotas,
                checks=checks,
                router=ModelRouter(settings, load.load),
                streams=slots,
                jobs=jobs,
            )
        )
        keeping = Background()  # cancelled before Redis closes (callbacks run last first)
        keeping.start(keep_records(chat.inflight))
        stack.push_async_callback(keeping.cancel)
        keys = KeyStore(session, cache, set(settings.tiers))
        batches = BatchService(
            session,
            partial(transactional_producer, settings),
            cache,
            settings.gateway_max_user_file_bytes,
            settings.tiers,
        )
        # First at shutdown: their stops and marks go out before Kafka and Redis close.
        stack.push_async_callback(
            finish_all, [chat.running.background, batches.background], settings.kafka_send_timeout_s
        )
        yield Services(settings, keys, conversations, chat, cluster, session, load, batches)


async def finish_all(work: list[Background], within_s: float) -> None:
    await asyncio.gather(*(background.finish(within_s) for background in work))


def services(request: Request) -> Services:
    deps: Services = request.app.state.services
    return deps
