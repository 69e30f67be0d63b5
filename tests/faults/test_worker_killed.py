"""kill -9 of the worker while six conversations stream: another worker re-runs the
requests, every client shows one coherent reply, and each is stored once."""

from __future__ import annotations

import asyncio

import pytest

from tests.faults.checks import assert_conversations_complete, mid_stream
from tests.faults.driver import chatting, clients
from tests.faults.stack import FaultStack

pytestmark = pytest.mark.integration


async def test_a_worker_killed_mid_stream_is_replaced_and_every_reply_completes(
    stack: FaultStack,
) -> None:
    async with clients(stack, 6) as users, asyncio.timeout(420):  # a new worker starts
        async with chatting(users, 2):
            await mid_stream(users, 3)
            await stack.replace_worker()
        assert any(turn.restarts for user in users for turn in user.turns), "nothing re-ran"
        await assert_conversations_complete(stack, users)
