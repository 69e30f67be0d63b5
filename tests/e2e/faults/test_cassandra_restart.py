"""Cassandra stopped while replies finish: the persistence consumer keeps retrying and
commits nothing it could not write, so even a persistence consumer killed during the
outage loses nothing; once Cassandra is back every reply is stored exactly once."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.faults.checks import assert_conversations_complete, mid_stream
from tests.e2e.faults.driver import ChatClient, chatting, clients, watching
from tests.e2e.stack import Stack, servers_back, stop_server
from tests.waiting import until

pytestmark = pytest.mark.integration

WRITE_FAILED = "replies failed"  # persist's log line when a batch cannot be stored


async def test_cassandra_restarted_while_replies_finish_stores_each_once(
    stack: Stack,
) -> None:
    async with clients(stack, 6) as users, watching(stack, users, "Cassandra restarted"):
        async with chatting(users, 1):  # streaming needs no Cassandra: replies finish
            await mid_stream(users, len(users))  # every message taken
            await stop_server(stack.settings, "cassandra")
            await refused_while_down(stack, users[0])
        await until(  # held, uncommitted
            lambda: WRITE_FAILED in stack.persist.log(), what="persist failing to write"
        )
        stack.persist.kill()  # what it fetched but could not write must be read again
        await servers_back(stack.settings)
        await stack.replace_persist()
        await assert_conversations_complete(stack, users)


async def refused_while_down(stack: Stack, user: ChatClient) -> None:
    """A new message cannot be stored: a 503 to retry later, not a 500 (and, as the final
    check shows, nothing half-written)."""
    async with httpx.AsyncClient(base_url=stack.urls[1], timeout=60) as http:
        response = await http.post(
            f"/v1/conversations/{user.conversation}/messages",
            json={"content": "Are you there?"},
            headers=user.headers,
        )
    assert response.status_code == 503, response.text
    assert response.json()["error"]["type"] == "service_unavailable"
    assert int(response.headers["Retry-After"]) >= 1
