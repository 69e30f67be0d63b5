"""kill -9 of the worker while six conversations stream: the worker that replaces it
continues each reply that was under way from the text already published (no restart,
no repeated or missing text), every client shows one coherent reply equal to the stored
one, and each reply's tokens are counted once."""

from __future__ import annotations

import re

import pytest

from tests.e2e.faults.checks import assert_conversations_complete, mid_stream
from tests.e2e.faults.driver import MAX_TOKENS, Turn, chatting, clients, watching
from tests.e2e.stack import Stack

pytestmark = pytest.mark.integration

CONTINUED = re.compile(r"(r_\w+) attempt (\d+) continues attempt 1 after \d+ events")


async def test_a_worker_killed_mid_stream_is_replaced_and_every_reply_continues(
    stack: Stack,
) -> None:
    async with clients(stack, 6) as users, watching(stack, users, "a worker replaced mid-stream"):
        async with chatting(users, 2):
            await mid_stream(users, 3)
            replacement = await stack.replace_worker()
        continued = dict(CONTINUED.findall(replacement.log()))
        turns = [turn for user in users for turn in user.turns]
        assert continued, "no reply was continued:\n" + replacement.log()[-3000:]
        assert set(continued) <= {turn.request_id for turn in turns}
        for turn in turns:
            if turn.request_id in continued:
                check_continued_stream(turn)
        await assert_conversations_complete(stack, users)


def check_continued_stream(turn: Turn) -> None:
    """One reply as if no worker had died: no restart, every event of attempt 1, and the
    whole reply (ignore_eos) counted once."""
    kinds = [kind for kind, _ in turn.events]
    assert "restart" not in kinds, turn.events
    assert all(attempt == 1 for kind, attempt in turn.events if kind in ("token", "final"))
    assert kinds[-1] == "final" and turn.final is not None
    assert turn.final["finish_reason"] == "length", turn.final
    assert turn.final["usage"]["completion_tokens"] == MAX_TOKENS, turn.final
