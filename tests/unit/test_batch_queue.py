"""Queuing a batch's lines as one Kafka transaction, with stand-ins for the producer and
the store: a Kafka that never answers is a bounded wait, not a create that hangs, and a
batch queued is marked so even when the store fails at that moment; a cancel kept
before admission hears of it."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
from types import SimpleNamespace
from typing import Any, cast

import pytest
from aiokafka.errors import KafkaConnectionError, KafkaTimeoutError
from cassandra import OperationTimedOut
from cassandra.cluster import NoHostAvailable

from producers.batch_topic import CommitUnknown, send_all_or_none
from producers.gateway.batches.objects import utc_now, window_end_ms
from producers.gateway.batches.records import Answered, StoredBatch
from producers.gateway.batches.service import BatchService
from tandoor.policies.api_keys import Principal


class NeverAnswers:
    """aiokafka's start() waits for a transaction coordinator with no time limit."""

    def __init__(self) -> None:
        self.stopped = False

    async def start(self) -> None:
        await asyncio.Event().wait()

    async def stop(self) -> None:
        self.stopped = True


async def test_a_coordinator_that_never_answers_is_a_kafka_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The create hung: the batch, shown failed meanwhile, was queued once Kafka came
    back, beside the SDK's retries (each queued too)."""
    monkeypatch.setattr("producers.batch_topic.QUEUE_LIMIT_S", 0.05)
    producer = NeverAnswers()

    def make(transactional_id: str) -> Any:
        return producer

    with pytest.raises(KafkaTimeoutError):
        await asyncio.wait_for(send_all_or_none(make, "k", "b1", [b"{}"]), 5)
    assert producer.stopped


class StoreDownTwice:
    def __init__(self) -> None:
        self.tries: list[str] = []

    async def queued(self, batch_id: str) -> None:
        self.tries.append(batch_id)
        if len(self.tries) <= 2:
            raise NoHostAvailable("Cassandra is unreachable", {})


async def test_a_queued_batch_is_marked_so_once_the_store_answers_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its lines were in Kafka; unmarked (one failed write), it showed `failed`,
    "create it again", two minutes later, while its lines ran: a second run paid twice."""
    monkeypatch.setattr("producers.gateway.batches.service.MARK_RETRY_S", (0, 0, 0))
    service = BatchService(None, cast(Any, None), None)
    store = StoreDownTwice()
    service.batches = cast(Any, store)
    await service._mark_queued("b1")  # the create is answered: its lines are in Kafka
    await service.background.finish(within_s=5)
    assert store.tries == ["b1", "b1", "b1"]


class Transactional:
    """A producer whose commit or abort, once asked for, hears back late or never."""

    def __init__(
        self, hangs: str, send_fails: bool = False, answered_in_s: float | None = None
    ) -> None:
        self.hangs, self.send_fails, self.answered_in_s = hangs, send_fails, answered_in_s
        self.calls: list[str] = []

    async def _step(self, name: str) -> None:
        self.calls.append(name)
        if name == self.hangs:
            if self.answered_in_s is not None:  # late, but answered
                await asyncio.sleep(self.answered_in_s)
                return
            await asyncio.Event().wait()

    async def start(self) -> None:
        await self._step("start")

    async def begin_transaction(self) -> None:
        await self._step("begin")

    async def send(self, *_: Any, **__: Any) -> asyncio.Future[None]:
        if self.send_fails:
            raise KafkaConnectionError("the broker went away")
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    async def commit_transaction(self) -> None:
        await self._step("commit")

    async def abort_transaction(self) -> None:
        await self._step("abort")

    async def stop(self) -> None:
        self.calls.append("stop")


async def test_an_abort_that_never_ends_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The send failed, then the abort waited for the coordinator with no limit: the
    create hung until Kafka came back instead of a 503."""
    monkeypatch.setattr("producers.batch_topic.STOP_LIMIT_S", 0.05)
    producer = Transactional(hangs="abort", send_fails=True)
    with pytest.raises(KafkaConnectionError):
        await asyncio.wait_for(send_all_or_none(lambda _: producer, "k", "b1", [b"{}"]), 5)
    assert producer.calls == ["start", "begin", "abort", "stop"]


@pytest.mark.parametrize(("answered_in_s", "committed"), [(0.2, True), (None, False)])
async def test_a_commit_unanswered_is_no_refusal_and_is_waited_for_beside(
    monkeypatch: pytest.MonkeyPatch, answered_in_s: float | None, committed: bool
) -> None:
    """A commit cut off by the queuing limit was a 503 and a deleted batch whose lines
    may have been committed (and run, unseen, beside the SDK's retry); one left unknown
    showed `failed`, "create it again", while its lines waited their turn."""
    monkeypatch.setattr("producers.batch_topic.COMMIT_WAIT_S", 0.05)
    monkeypatch.setattr("producers.batch_topic.TRANSACTION_TIMEOUT_MS", 1000)
    producer = Transactional(hangs="commit", answered_in_s=answered_in_s)
    with pytest.raises(CommitUnknown) as unknown:
        await asyncio.wait_for(send_all_or_none(lambda _: producer, "k", "b1", [b"{}"]), 5)
    assert producer.calls == ["start", "begin", "commit"]  # not aborted, not stopped yet
    assert await asyncio.wait_for(unknown.value.committed, 5) is committed
    assert producer.calls[-1] == "stop"


class OneBatch:
    """A store of one batch: its cancel fails while `down`; its lines' answers as set."""

    def __init__(self, batch: StoredBatch) -> None:
        self.batch, self.down, self.codes = batch, False, list[int | None]()

    async def get(self, batch_id: str) -> StoredBatch:
        return self.batch

    async def cancel(self, batch_id: str, at: dt.datetime) -> None:
        if self.down:
            raise OperationTimedOut("the cancel's write timed out")
        self.batch = dataclasses.replace(self.batch, cancelled_at=at)

    async def answered(self, user_id: str, batch_id: str) -> Answered:
        answered_at = utc_now() + dt.timedelta(seconds=1)  # after the cancel, whatever the clock
        return Answered.of(self.codes, answered_at if self.codes else None)

    async def settle(self, batch_id: str, answered: Answered) -> None:
        self.batch = dataclasses.replace(self.batch, settled=answered)


def batch_service(batch: StoredBatch) -> tuple[BatchService, OneBatch, list[str]]:
    redis, told = SimpleNamespace(), list[str]()

    async def set_key(key: str, value: object, ex: int) -> None:
        told.append(key)

    redis.set = set_key
    service = BatchService(None, cast(Any, None), redis)
    store = OneBatch(batch)
    service.batches = cast(Any, store)
    return service, store, told


def stored_batch(age: dt.timedelta, queuing: bool = False) -> StoredBatch:
    created = utc_now() - age
    return StoredBatch(
        "b", "u", "f", "/v1/chat/completions", "24h", 3, None, created, None, queuing=queuing
    )


async def test_a_cancel_whose_store_failed_is_not_told_to_admission_until_it_is_kept() -> None:
    """Told first, admission answered every line `batch_cancelled` while the batch,
    with no cancel stored, showed `completed` and the client's retry got a 409."""
    service, store, told = batch_service(stored_batch(dt.timedelta(hours=1)))
    caller = Principal("u", "batch", "k")
    store.down = True
    with pytest.raises(OperationTimedOut):
        await service.cancel(caller, "b")
    assert told == [], "no line cancelled while the batch does not say so"
    store.down = False
    assert (await service.cancel(caller, "b"))["status"] == "cancelling"
    assert (await service.cancel(caller, "b"))["status"] == "cancelling"  # told again
    assert len(told) == 2
    store.codes = [None, None, None]  # admission answered them `batch_cancelled`
    assert (await service.retrieve(caller, "b"))["status"] == "cancelled"


async def test_a_batch_whose_queued_mark_was_lost_can_be_cancelled() -> None:
    """Its lines may be in Kafka (the mark after their commit failed): shown `failed`
    with "create it again", it refused a cancel, and the lines ran, twice if created
    again."""
    service, _, told = batch_service(stored_batch(dt.timedelta(minutes=3), queuing=True))
    caller = Principal("u", "batch", "k")
    assert (await service.retrieve(caller, "b"))["status"] == "failed"
    assert (await service.cancel(caller, "b"))["status"] == "cancelled"
    assert len(told) == 1


def test_lines_expire_when_the_window_ends_to_the_millisecond() -> None:
    """Rounded down to the second, lines answered `batch_expired` up to a second before
    the window's end showed the batch `completed`, then `expired`."""
    batch = stored_batch(dt.timedelta(0))
    batch = dataclasses.replace(batch, created_at=dt.datetime(2026, 12, 5, 12, 0, 0, 900_000))
    end = dt.datetime(2026, 12, 6, 12, 0, 0, 900_000, tzinfo=dt.UTC)
    assert window_end_ms(batch) == round(end.timestamp() * 1000)
