"""kill -9 of a gateway replica while six conversations stream through both: its
clients resume with Last-Event-ID on the other replica (or on the restarted one) and
get the whole reply."""

from __future__ import annotations

import pytest

from tests.e2e.faults.checks import assert_conversations_complete, mid_stream
from tests.e2e.faults.driver import chatting, clients, watching
from tests.e2e.stack import Stack

pytestmark = pytest.mark.integration


async def test_a_gateway_killed_mid_stream_its_clients_resume_elsewhere(
    stack: Stack,
) -> None:
    async with clients(stack, 6) as users, watching(stack, users, "a gateway replaced mid-stream"):
        async with chatting(users, 2):
            await mid_stream(users, 4)
            await stack.replace_gateway(0)
        resumed = [t for u in users for t in u.turns if t.resumes or t.from_history]
        assert resumed, "no stream was cut"
        # Read from history, a reply is checked against itself: one at least must have
        # gone on streaming where it was resumed.
        assert any(t.resumes and not t.from_history for t in resumed), "none resumed a stream"
        await assert_conversations_complete(stack, users)
