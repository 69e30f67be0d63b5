"""A prompt taken while Redis did not answer (no lease) takes its lease as soon as
Redis answers, records from then on if nothing went out unrecorded, and stops if
another worker took the request meanwhile (workers/request.py)."""

from __future__ import annotations

from typing import Any, cast

import pytest

from schemas.events import now_ms
from tests.unit.test_transcript_records import LeasesKept, prompt
from workers import recording
from workers.attempt import Attempt, LeaseLost, Tracked
from workers.ledger import UNKNOWN_TEXT, Arrival, Recorded, Recording, RequestLedger
from workers.metrics import WorkerMetrics
from workers.request import RequestRunner, RunnerConfig


class LateRedis:
    """Answers lease_late from `answers`; records like Redis: no gap allowed."""

    leases = LeasesKept()

    def __init__(self, *answers: str) -> None:
        self.answers = list(answers)
        self.asked = 0
        self.transcript: list[int] = []

    async def lease_late(self, request_id: str) -> str:
        self.asked += 1
        return self.answers.pop(0)

    async def record(self, request_id: str, attempt: int, entry: Recorded) -> Recording:
        if entry.seq != len(self.transcript):
            return "gap"
        self.transcript.append(entry.seq)
        return "ok"

    async def forget_transcript(self, request_id: str, attempt: int, begun: bool = False) -> str:
        self.transcript = [UNKNOWN_TEXT.seq] if begun else []
        return "ok"

    async def holds(self, request_id: str, attempt: int) -> str:
        return "ok"


def runner(ledger: LateRedis) -> RequestRunner:
    unused = cast(Any, None)  # _record needs only the ledger
    config = RunnerConfig("m", 0.05, 16)
    return RequestRunner(config, unused, unused, cast(RequestLedger, ledger), unused, unused)


def unleased() -> Attempt:
    return Attempt(prompt(), Tracked("r_1"), 1, 1, recording=False)


@pytest.fixture(autouse=True)
def ask_every_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recording, "LEASE_ASK_S", 0.0)


async def test_leased_before_its_first_event_it_records_them_all() -> None:
    ledger, attempt = LateRedis("ok"), unleased()
    for seq in range(4):
        await runner(ledger)._record(attempt, Recorded(1, seq, "x", 1))
    assert attempt.tracked.leased and attempt.recording
    assert ledger.transcript == [0, 1, 2, 3] and ledger.asked == 1


async def test_leased_after_events_went_out_unrecorded_it_leaves_no_partial_transcript() -> None:
    ledger, attempt = LateRedis("down", "ok"), unleased()
    for seq in range(4):
        await runner(ledger)._record(attempt, Recorded(1, seq, "x", 1))
    assert attempt.tracked.leased, "renewed from now on, a redelivery waits for it"
    assert ledger.asked == 2 and not attempt.recording
    assert ledger.transcript == [UNKNOWN_TEXT.seq], "no partial transcript, but begun"


async def test_taken_by_another_worker_meanwhile_it_stops() -> None:
    ledger, attempt = LateRedis("down", "lost"), unleased()
    await runner(ledger)._record(attempt, Recorded(1, 0, "x", 1))
    with pytest.raises(LeaseLost):
        await runner(ledger)._record(attempt, Recorded(1, 1, "x", 1))
    assert attempt.tracked.lost and not attempt.tracked.leased


async def test_a_reply_begun_whose_text_is_unknown_restarts_past_its_deadline() -> None:
    """Its transcript was dropped mid-reply: the next attempt restarts the reply for the
    reader who has part of it, rather than answer "expired"."""
    late = prompt().model_copy(update={"deadline_ms": now_ms() - 1})
    for transcript, expired in (((UNKNOWN_TEXT,), False), ((), True)):
        arrival = Arrival(attempt=2, cancelled=False, leased=True, transcript=transcript)
        attempt = await runner(LateRedis())._attempt(late, Tracked("r_1"), arrival)
        assert not attempt.carried and attempt.epoch == 2
        assert attempt.expired() is expired, transcript


class RedisDownAtTheEnd(LateRedis):
    """Redis does not answer the finish: the ledger lets the final go out unrecorded."""

    async def finish(self, request_id: str, attempt: int, final: bytes) -> str:
        return "down"


class Finals:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    async def final(self, final: Any, partition: int) -> None:
        self.sent.append(final)


def finishing(ledger: LateRedis, finals: Finals) -> RequestRunner:
    """A runner whose `_finish` publishes to `finals`."""
    unused = cast(Any, None)
    config, metrics = RunnerConfig("m", 0.05, 16), WorkerMetrics("m")
    return RequestRunner(
        config, unused, cast(Any, finals), cast(RequestLedger, ledger), unused, metrics
    )


async def test_an_attempt_that_knows_its_lease_was_lost_publishes_no_final() -> None:
    """Its renewal heard "not ours" (another worker runs the request) and the engine
    was stopped, ending the attempt "cancelled"; with Redis silent at the finish, that
    final went out while the other worker still streamed the reply."""
    ledger, finals = RedisDownAtTheEnd(), Finals()
    attempt = Attempt(prompt(), Tracked("r_1", leased=True), 1, 1)
    attempt.tracked.lost = True
    with pytest.raises(LeaseLost):
        await finishing(ledger, finals)._finish(attempt, "cancelled", None)
    assert finals.sent == []


async def test_an_end_redis_did_not_record_is_marked_to_be_recorded_after() -> None:
    """Taken while Redis was away and still unleased as it ends, or leased and Redis
    away at the end: its final goes out, marked to be recorded done once it is out
    (workers/late_done.py); unmarked, the prompt fetched again after the outage was
    answered a second time."""
    for attempt, ledger in (
        (unleased(), LateRedis("down")),
        (Attempt(prompt(), Tracked("r_1", leased=True), 1, 1), RedisDownAtTheEnd()),
    ):
        finals = Finals()
        await finishing(ledger, finals)._finish(attempt, "stop", None)
        assert attempt.tracked.unrecorded_final is not None
        assert [final.finish_reason for final in finals.sent] == ["stop"]
