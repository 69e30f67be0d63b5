"""A resumed reply frees its concurrent-stream slot before the client hears its end
(stand-ins for the in-flight record and the quotas)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any, cast

from consumers.fanout import Delivered
from producers.gateway.chat.control import ReplyControl, Resumed
from tandoor.policies.api_keys import Principal
from tandoor.policies.quota import Admission
from tandoor.settings import Settings
from tests.unit.test_persist_retries import final


class Released:
    def __init__(self) -> None:
        self.done: list[str] = []
        self.accounts: list[str] = []

    async def release(self, *args: Any) -> None:  # (conversation, request) or (admission)
        found = args[0].request_id if isinstance(args[0], Admission) else args[1]
        self.done.append(found)
        if isinstance(args[0], Admission):
            self.accounts.append(args[0].account)


async def test_a_resumed_replys_slot_is_free_before_its_end_is_sent() -> None:
    """Freed only once the usage record reached the streams app, after the final: a
    user of one stream who posted right after the end got a 429."""
    inflight, quotas = Released(), Released()
    stand_ins = cast(Any, None), cast(Any, None), cast(Any, inflight), cast(Any, quotas)
    control = ReplyControl(Settings(), *stand_ins)

    async def events() -> AsyncGenerator[Delivered, None]:
        yield Delivered(0, 7, final("r_1"))

    caller = Principal("u1", "free", "k")
    sent = []
    resumed = Resumed({"request_id": "r_1"})
    async for item in control._clearing_when_final(caller, "c_1", resumed, events()):
        assert quotas.done == ["r_1"] and inflight.done == ["r_1"]  # as the end goes out
        assert resumed.ending, "a drain lets the stream finish: its record is gone"
        sent.append(item)
    assert len(sent) == 1


async def test_a_client_leaving_while_its_end_is_settled_still_frees_its_slot() -> None:
    """Its leaving cancelled the read, and the releases with it: the slot stayed taken
    until the streams app freed it (a 429 for a user of one stream meanwhile)."""
    releasing, go_on = asyncio.Event(), asyncio.Event()

    class Slow(Released):
        async def release(self, *args: Any) -> None:
            releasing.set()
            await go_on.wait()  # a Redis round trip
            await super().release(*args)

    inflight, quotas = Slow(), Released()
    stand_ins = cast(Any, None), cast(Any, None), cast(Any, inflight), cast(Any, quotas)
    control = ReplyControl(Settings(), *stand_ins)

    async def events() -> AsyncGenerator[Delivered, None]:
        yield Delivered(0, 7, final("r_1"))

    resumed = Resumed({"request_id": "r_1"})
    stream = control._clearing_when_final(Principal("u1", "free", "k"), "c_1", resumed, events())
    reading = asyncio.ensure_future(anext(stream))
    await asyncio.wait_for(releasing.wait(), 10)
    reading.cancel()  # the client went
    await asyncio.gather(reading, return_exceptions=True)
    go_on.set()
    await control.background.finish(within_s=10)
    assert inflight.done == ["r_1"] and quotas.done == ["r_1"]


async def test_a_reply_resumed_with_a_key_of_another_tier_frees_the_slot_it_was_charged() -> None:
    """Charged to the user's plus counters, resumed with their api key: the release went
    to the api counters, and the plus slot stayed taken (a 429 on the next post)."""
    inflight, quotas = Released(), Released()
    stand_ins = cast(Any, None), cast(Any, None), cast(Any, inflight), cast(Any, quotas)
    control = ReplyControl(Settings(), *stand_ins)

    async def events() -> AsyncGenerator[Delivered, None]:
        yield Delivered(0, 7, final("r_1"))

    resumed = Resumed({"request_id": "r_1", "tier": "plus"})
    async for _ in control._clearing_when_final(
        Principal("u1", "api", "k"), "c", resumed, events()
    ):
        pass
    await control.background.finish(within_s=10)
    assert quotas.accounts == ["u1:plus"]
