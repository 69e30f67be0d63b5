"""Redis down: each tier follows its policy (docs/architecture.md "When Redis is down"). Paid tiers
fail open: their chats are served, uncounted, and stored (stop answers a 503: it needs
the in-flight record). The free tier fails closed: a 503 with Retry-After and nothing
written. Once Redis is back, quotas count again."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager

import httpx
import pytest

from tandoor.clients import redis_client
from tests.e2e.faults.checks import assert_conversations_complete
from tests.e2e.faults.driver import ChatClient, chat_all, clients, watching
from tests.e2e.stack import Stack, server, servers_back, stop_server

pytestmark = pytest.mark.integration


async def post(
    stack: Stack, user: ChatClient, content: str, path: str = "messages"
) -> httpx.Response:
    async with httpx.AsyncClient(base_url=stack.urls[0], timeout=60) as http:
        return await http.post(
            f"/v1/conversations/{user.conversation}/{path}",
            json={"content": content, "max_tokens": 8} if content else None,
            headers=user.headers,
        )


async def test_redis_down_paid_tiers_are_served_and_the_free_tier_gets_a_503(
    stack: Stack,
) -> None:
    async with (
        clients(stack, 3, "plus") as paid,
        clients(stack, 1, "free") as (free,),
        clients(stack, 1, "tight") as (tight,),  # 2 requests a minute, fails open
        watching(stack, [*paid, free, tight], "Redis down and back"),
    ):
        await stop_server(stack.settings, "redis")
        try:
            await chat_all([*paid, tight], 1)
            refused = await post(stack, free, "Am I served?")
            stop = await post(stack, paid[0], "", path="stop")  # no in-flight record to read
            async with httpx.AsyncClient(base_url=stack.urls[0], timeout=60) as http:
                usage = await http.get("/v1/usage", headers=paid[0].headers)
                ready = await http.get("/ready")
        finally:
            await servers_back(stack.settings)
        # Still in service: a probe that failed on Redis took every replica out of the
        # load balancer, and the paid tiers it serves with them.
        assert ready.status_code == 200, ready.text
        assert ready.json()["checks"] == {
            "redis": False,
            "cassandra": True,
            "kafka": True,
            "accepting": True,
        }
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["type"] == "service_unavailable"
        assert int(refused.headers["Retry-After"]) >= 1
        assert stop.status_code == 503 and "Retry-After" in stop.headers, stop.text
        # The usage page still answers: stored usage from Cassandra, quota use unknown.
        assert usage.status_code == 200, usage.text
        limits = usage.json()["limits"]
        assert {name: limit["used"] for name, limit in limits.items()} == dict.fromkeys(limits)
        assert (
            limits["requests_per_minute"]["limit"]
            == stack.settings.tiers["plus"].requests_per_minute
        )

        # Two short replies: the limit counts each request for 60 s, so the third must
        # follow the first within them, on a slow CPU too.
        await tight.chat(2, max_tokens=2)  # the request during the outage was not counted...
        over = await post(stack, tight, "One more?")  # ...and now the quota applies again
        assert over.status_code == 429, over.text
        assert over.json()["error"]["param"] == "requests_per_minute"
        await free.chat(1)  # served again
        await assert_conversations_complete(stack, [*paid, free, tight])


@contextlib.asynccontextmanager
async def frozen(stack: Stack) -> AsyncIterator[None]:
    """Redis stopped (SIGSTOP) with its port open: connections are taken, nothing is
    ever answered, as when it swaps, hangs or its host stalls."""
    pid = server(stack.settings, "redis").process.pid()
    assert pid is not None, "redis is not running"
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


@contextlib.asynccontextmanager
async def full(stack: Stack) -> AsyncIterator[None]:
    """Redis at its memory limit with nothing it may evict: reads answer, writes are
    refused (OOM), as a deployed one with `maxmemory` and a volatile policy can be."""
    async with redis_client(stack.settings) as redis:
        await redis.config_set("maxmemory", 1)
        try:
            yield
        finally:
            await redis.config_set("maxmemory", 0)


@pytest.mark.parametrize(
    ("failing", "free_refused"), [(frozen, True), (full, False)], ids=["frozen", "full"]
)
async def test_a_frozen_or_full_redis_is_down_for_the_tiers(
    stack: Stack,
    failing: Callable[[Stack], AbstractAsyncContextManager[None]],
    free_refused: bool,
) -> None:
    """Frozen: without a read timeout every call to a Redis that took the connection
    and never answered hung, and chats of every tier waited until their client gave up.
    Full: its writes refused (OOM) were errors nothing handled, a 500 for every chat (the
    quota's script still runs there, so the free tier may be served)."""
    async with (
        clients(stack, 1, "plus") as (paid,),
        clients(stack, 1, "free") as (free,),
        watching(stack, [paid, free], "Redis failing and back"),
    ):
        async with failing(stack):
            await paid.chat(1)
            refused = await post(stack, free, "Am I served?") if free_refused else None
            async with httpx.AsyncClient(base_url=stack.urls[0], timeout=60) as http:
                ready = await http.get("/ready")  # a frozen Redis is named, not a hung check
        assert ready.status_code == 200, ready.text
        assert ready.json()["checks"]["redis"] is (failing is full)  # a full one answers pings
        if refused is not None:
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["type"] == "service_unavailable"
        await free.chat(1)  # served once Redis answers again
        await assert_conversations_complete(stack, [paid, free])
