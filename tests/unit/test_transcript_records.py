"""A worker whose transcript record fails stops recording, and drops the transcript as
soon as Redis answers again, so no later worker continues from a transcript shorter
than what was published (workers/request.py)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from schemas.events import ChatMessage, PromptRequest, now_ms
from workers.attempt import Attempt, LeaseLost, Tracked, usage_of
from workers.engine import EngineOutput, RequestFailed
from workers.ledger import Recorded, Recording, RequestLedger
from workers.metrics import WorkerMetrics
from workers.request import RequestRunner, RunnerConfig


class LeasesKept:
    """A ledger's lease clock for stand-ins that answer for Redis: never lapsed here."""

    def lapsed(self, request_id: str) -> bool:
        return False


class RedisAway:
    """Answers the first record with "down", then the deletes: twice not, then yes; then
    the lease checks from `held` (the lease is ours until another worker takes it)."""

    leases = LeasesKept()

    def __init__(self, held: tuple[str, ...] = ("ok", "ok")) -> None:
        self.records = 0
        self.deletes: list[bool] = []
        self._answers = ["down", "down", "ok"]
        self.held = list(held)

    async def record(self, request_id: str, attempt: int, entry: Recorded) -> Recording:
        self.records += 1
        return "down"

    async def forget_transcript(self, request_id: str, attempt: int, begun: bool = False) -> str:
        answer = self._answers.pop(0)
        self.deletes.append(answer == "ok")
        return answer

    async def holds(self, request_id: str, attempt: int) -> str:
        return self.held.pop(0)


def prompt() -> PromptRequest:
    return PromptRequest(
        request_id="r_1",
        model="m",
        user_id="u",
        tier="plus",
        band="interactive-paid",
        conversation_id="c",
        messages=[ChatMessage(role="user", content="hi")],
        created_at_ms=now_ms(),
    )


def attempt() -> Attempt:
    return Attempt(prompt(), Tracked("r_1", leased=True), 1, 1, recording=True)


async def test_a_failed_record_drops_the_transcript_once_redis_answers() -> None:
    ledger = RedisAway()
    config = RunnerConfig("m", 0.05, 16)
    unused = cast(Any, None)  # _record needs only the ledger
    runner = RequestRunner(config, unused, unused, cast(RequestLedger, ledger), unused, unused)
    current = attempt()
    for seq in range(5):
        await runner._record(current, Recorded(1, seq, "x", 1))
    assert ledger.records == 1, "no record after the first failure"
    assert ledger.deletes == [False, False, True], "deleted until Redis answered, then no more"
    assert not current.recording and not current.stale_transcript
    assert ledger.held == [], "the lease asked at each event past the drop"


async def test_a_worker_that_no_longer_records_stops_at_the_first_event_past_its_lease() -> None:
    """Its record failed (Redis stalled past its lease): another worker took the request
    meanwhile. It went on publishing unrecorded events until its renewal loop noticed
    (a third of the lease later), beside the worker that took over."""
    ledger = RedisAway(held=("ok", "lost"))
    unused = cast(Any, None)
    runner = RequestRunner(
        RunnerConfig("m", 0.05, 16), unused, unused, cast(RequestLedger, ledger), unused, unused
    )
    current = attempt()
    for seq in range(4):  # a failed record, two drops while Redis is away, one checked
        await runner._record(current, Recorded(1, seq, "x", 1))
    with pytest.raises(LeaseLost):
        await runner._record(current, Recorded(1, 4, "x", 1))
    assert current.tracked.lost


class PromptOf20Tokens:
    max_model_len = 2048

    async def prompt_tokens(self, messages: object, partial: str | None = None) -> list[int]:
        return list(range(20))


class Accepting:
    async def token(self, event: object, key: str, partition: int | None) -> Any:
        return None


async def test_a_continued_reply_that_ends_before_its_engine_counts_its_prompt() -> None:
    """A continuation that used up the reply's budget (or was stopped) ends before its
    engine: the prompt, read by the engine of the attempt it continues, was counted as
    0 tokens, and the quota settled gave its charge back."""
    config, unused = RunnerConfig("m", 0.05, 16), cast(Any, None)
    engine, publisher = cast(Any, PromptOf20Tokens()), cast(Any, Accepting())
    runner = RequestRunner(config, engine, publisher, unused, unused, unused)
    carried = tuple(Recorded(1, seq, "x", 1) for seq in range(5))
    continuing = Attempt(prompt(), Tracked("r_1", leased=True), 2, 1, carried)
    await runner._republish(continuing)
    usage = usage_of(continuing)
    assert (usage.prompt_tokens, usage.completion_tokens) == (20, 5)


class FailsAfterThreeTokens:
    async def generate(self, request_id: str, token_ids: object, sampling: object) -> Any:
        yield EngineOutput("Hello", 1, False, None, 3, 0)
        yield EngineOutput(" world", 1, False, None, 3, 0)  # the first word ended: sent
        yield EngineOutput(" again", 1, False, None, 3, 0)  # held for the window
        raise RequestFailed("engine dead")


class Delivering:
    async def token(self, event: object, key: str, partition: int | None) -> Any:
        delivered = asyncio.get_running_loop().create_future()
        delivered.set_result(None)
        return delivered


class RecordsAll:
    leases = LeasesKept()

    async def record(self, request_id: str, attempt: int, entry: Recorded) -> str:
        return "ok"


def streaming_runner(engine: object, coalesce_s: float) -> RequestRunner:
    """A runner that streams from `engine`, every delivery and record taken."""
    return RequestRunner(
        RunnerConfig("m", coalesce_s, 16),
        cast(Any, engine),
        cast(Any, Delivering()),
        cast(RequestLedger, RecordsAll()),
        cast(Any, None),
        WorkerMetrics("m"),
    )


async def test_text_made_before_the_engine_fails_is_sent_as_it_is_charged() -> None:
    """Its coalesced tokens not yet sent were dropped when the engine failed the request,
    but counted in the usage: the stored reply lacked text its user was charged for."""
    runner = streaming_runner(FailsAfterThreeTokens(), 60.0)  # nothing sent before the failure
    current = attempt()
    with pytest.raises(RequestFailed):
        await runner._stream(current, [1, 2, 3], 16)
    assert "".join(current.text) == "Hello world again" and current.completion_tokens == 3
