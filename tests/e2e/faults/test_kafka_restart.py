"""Kafka stopped and started again (same data) while six conversations stream: the
roles reconnect by themselves, clients resume, and nothing is lost or doubled. A
message sent while Kafka is down gets a 503 (kept as failed) and is sent again: it is
answered once, and the failed try never is."""

from __future__ import annotations

import pytest

from tests.e2e.faults.checks import assert_conversations_complete, mid_stream
from tests.e2e.faults.driver import chatting, clients, watching
from tests.e2e.stack import Stack, servers_back, stop_server
from tests.waiting import until

pytestmark = pytest.mark.integration


async def test_kafka_restarted_mid_stream_loses_nothing(stack: Stack) -> None:
    async with (
        clients(stack, 7) as (*users, late),
        watching(stack, [*users, late], "Kafka restarted mid-stream"),
    ):
        async with chatting(users, 2) as chats:
            await mid_stream(users, 3)
            await stop_server(stack.settings, "kafka")
            crossing = [turn for user in users for turn in user.turns if not turn.done]
            assert crossing, "every reply ended before Kafka was down: none crossed it"
            chats.create_task(late.chat(1))
            await until(lambda: bool(late.turns and late.turns[0].refused), what="a 503")
            await servers_back(stack.settings)
        assert 503 in late.turns[0].refused, "the send during the outage was not refused"
        await assert_conversations_complete(stack, [*users, late])
