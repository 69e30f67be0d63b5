"""kill -9 of the worker while six conversations stream: another worker re-runs the
requests; each open stream shows one restart event and then the rerun, never repeated
text; every client shows one coherent reply, and each is stored once."""

from __future__ import annotations

import pytest

from tests.e2e.faults.checks import assert_conversations_complete, mid_stream
from tests.e2e.faults.driver import MAX_TOKENS, Turn, chatting, clients, watching
from tests.e2e.stack import Stack

pytestmark = pytest.mark.integration


async def test_a_worker_killed_mid_stream_is_replaced_and_every_reply_completes(
    stack: Stack,
) -> None:
    async with clients(stack, 6) as users, watching(stack, users, "a worker replaced mid-stream"):
        async with chatting(users, 2):
            await mid_stream(users, 3)
            await stack.replace_worker()
        restarted = [turn for user in users for turn in user.turns if turn.restarts]
        assert restarted, "nothing re-ran"
        for turn in restarted:
            check_restarted_stream(turn)
        await assert_conversations_complete(stack, users)


def check_restarted_stream(turn: Turn) -> None:
    """The first attempt's tokens, one restart, then only the new attempt's tokens and its
    final: the whole reply (ignore_eos), never the old text again."""
    kinds = [kind for kind, _ in turn.events]
    assert kinds.count("restart") == 1, kinds
    restart = kinds.index("restart")
    rerun = turn.events[restart][1]
    assert rerun >= 2 and all(a < rerun for k, a in turn.events[:restart] if k == "token")
    after = turn.events[restart + 1 :]
    assert after and all(k in ("token", "final") and a == rerun for k, a in after), after
    assert kinds[-1] == "final" and turn.final is not None
    assert turn.final["attempt"] == rerun and turn.final["finish_reason"] == "length"
    assert turn.final["usage"]["completion_tokens"] == MAX_TOKENS
