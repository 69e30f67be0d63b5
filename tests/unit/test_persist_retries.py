"""How persistence retries a write, with a stand-in for its Cassandra writer (the real
one: tests/integration/test_persist_faults.py): a final the store refuses is dead-lettered
after POISON_TRIES, one it cannot reach is retried for as long as it takes. Tries were
counted by offset alone, so a final sharing its offset with a poison one on another
partition was dead-lettered with it (its reply never stored)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from aiokafka.errors import KafkaConnectionError, MessageSizeTooLargeError
from aiokafka.structs import ConsumerRecord
from cassandra import InvalidRequest, Unauthorized
from cassandra.cluster import NoHostAvailable

from consumers.persist import POISON_TRIES, Persister
from schemas.events import FinalEvent, Usage
from tandoor.settings import Settings
from tests.unit.test_rollups import final_event
from tests.waiting import until

UNREACHABLE_TRIES = POISON_TRIES  # as many rounds unreachable as the poison one takes


def final(request_id: str) -> FinalEvent:
    return final_event(request_id, attempt=1)


def record(partition: int, offset: int) -> ConsumerRecord[bytes, bytes]:
    return ConsumerRecord("tokens", partition, offset, 0, 0, b"k", b"v", None, 1, 1, [])


class StandInWriter:
    def __init__(self) -> None:
        self.tries: dict[str, int] = {}

    async def store(self, stored: FinalEvent) -> None:
        tries = self.tries[stored.request_id] = self.tries.get(stored.request_id, 0) + 1
        if stored.request_id == "poison":
            raise ValueError("refused by the store")
        if tries <= UNREACHABLE_TRIES:
            raise NoHostAvailable("Cassandra is unreachable", {})


async def test_a_final_sharing_its_offset_with_a_poison_one_is_stored_not_dead_lettered() -> None:
    persister = Persister(Settings())
    writer = StandInWriter()
    persister._writer = writer  # type: ignore[assignment]
    dead: list[tuple[int, int]] = []

    async def dead_letter(dropped: ConsumerRecord[bytes, bytes], _: str) -> bool:
        dead.append((dropped.partition, dropped.offset))
        return True

    persister._dead_letter = dead_letter  # type: ignore[method-assign,assignment]
    try:
        stored = await persister._store(
            [(record(0, 100), final("poison")), (record(3, 100), final("good"))]
        )
    finally:
        await persister._producer.stop()  # never started: closed for their finalizers
        await persister._consumer.stop()
    assert dead == [(0, 100)]
    # Only the good one's batch result may go out: the poison one has no stored answer.
    assert stored is not None and [f.request_id for _, f in stored] == ["good"]
    assert writer.tries == {"poison": POISON_TRIES, "good": UNREACHABLE_TRIES + 1}


class RefusingEveryWrite:
    """Cassandra refusing every write alike for `rounds` rounds, then taking them."""

    def __init__(self, refusal: Exception, rounds: int) -> None:
        self.refusal, self.rounds, self.tries = refusal, rounds, 0

    async def store(self, _: FinalEvent) -> None:
        self.tries += 1
        if self.tries <= self.rounds:
            raise self.refusal


async def stored_and_dead(writer: object, finals: list[str]) -> tuple[list[str], int]:
    """What `_store` stored of `finals` and how many it dead-lettered."""
    persister = Persister(Settings())
    persister._writer = writer  # type: ignore[assignment]
    dead: list[int] = []

    async def dead_letter(dropped: ConsumerRecord[bytes, bytes], _: str) -> bool:
        dead.append(dropped.offset)
        return True

    persister._dead_letter = dead_letter  # type: ignore[method-assign,assignment]
    try:
        items = [(record(0, i), final(f)) for i, f in enumerate(finals)]
        stored = await persister._store(items)
    finally:
        await persister._producer.stop()
        await persister._consumer.stop()
    return [f.request_id for _, f in stored or []], len(dead)


@pytest.mark.parametrize(
    "refusal",
    [
        Unauthorized("User persist has no MODIFY permission on <table tandoor.messages>"),
        InvalidRequest(
            'Error from server: code=2200 [Invalid query] message="unconfigured table usage_by_day"'
        ),
        InvalidRequest(
            "Error from server: code=2200 [Invalid query] "
            'message="table usage_by_day does not exist"'
        ),
        InvalidRequest(
            'Error from server: code=2200 [Invalid query] message="keyspace tandoor does not exist"'
        ),
        InvalidRequest(
            "Error from server: code=2200 [Invalid query] message=\"Keyspace 't' does not exist\""
        ),
    ],
    # Cassandra 4's words, then 5's (as a dropped table's prepared insert met on 5.0.6).
    ids=["grant revoked", "table missing", "table missing (5.0)", "keyspace missing", "Scylla"],
)
async def test_a_refusal_of_every_write_is_waited_out_not_dead_lettered(refusal: Exception) -> None:
    """A revoked grant or a table missing mid-restore refuses every final alike: they were
    each dead-lettered after POISON_TRIES (0.3 s), every reply of the outage missing from
    the history until replayed by hand."""
    writer = RefusingEveryWrite(refusal, rounds=POISON_TRIES + 1)
    assert await stored_and_dead(writer, ["a"]) == (["a"], 0)


async def test_a_refusal_of_every_write_past_its_wait_is_dead_lettered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Waited out for good, one table's refusal (a batch line's grant forgotten) held up
    every other reply's write behind it."""
    monkeypatch.setattr("consumers.write_refusals.REFUSAL_WAIT_S", 0.25)
    writer = RefusingEveryWrite(Unauthorized("no MODIFY on <table batch_outputs>"), rounds=99)
    assert await stored_and_dead(writer, ["a"]) == ([], 1)
    assert writer.tries > POISON_TRIES  # the wait first


async def test_a_refusal_of_that_final_alone_is_still_dead_lettered() -> None:
    too_long = InvalidRequest("Key length of 70000 is longer than maximum of 65535")
    writer = RefusingEveryWrite(too_long, rounds=POISON_TRIES + 1)
    assert await stored_and_dead(writer, ["a"]) == ([], 1)


class FlakyProducer:
    """Kafka refusing the first `failures` sends (a broker restarting)."""

    def __init__(self, failures: int) -> None:
        self.failures, self.sent = failures, 0

    async def send_and_wait(self, *_: Any, **__: Any) -> None:
        if self.failures:
            self.failures -= 1
            raise KafkaConnectionError("broker restarting")
        self.sent += 1


async def test_a_dead_letter_kafka_refuses_for_a_while_is_sent_when_it_takes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The send was made once: its KafkaError stopped persistence, and every restart met
    the same final again."""
    monkeypatch.setattr("consumers.persist.SEND_RETRY_S", 0.0)
    persister = Persister(Settings())
    real, flaky = persister._producer, FlakyProducer(failures=3)
    persister._producer = flaky  # type: ignore[assignment]
    try:
        assert await persister._dead_letter(record(0, 7), "refused by the store")
        assert flaky.sent == 1
        flaky.failures = 1
        persister.request_stop()  # told to stop meanwhile: left for the next owner
        assert not await persister._dead_letter(record(0, 8), "refused by the store")
        assert flaky.sent == 1
    finally:
        await real.stop()
        await persister._consumer.stop()


class TakingProducer:
    """Kafka taking every send of up to `limit` bytes, headers counted; past it, refused
    as aiokafka does before sending (`MessageSizeTooLargeError`, a KafkaError)."""

    def __init__(self, limit: int = 1_000_000) -> None:
        self.limit = limit
        self.sent: list[tuple[str, bytes, list[tuple[str, bytes]]]] = []

    async def send(
        self, topic: str, value: bytes, key: bytes | None = None, headers: Any = None
    ) -> asyncio.Future[None]:
        size = len(value) + sum(len(name) + len(data) for name, data in headers or [])
        if size > self.limit:
            raise MessageSizeTooLargeError(f"{size} bytes")
        self.sent.append((topic, value, list(headers or [])))
        delivered = asyncio.get_running_loop().create_future()
        delivered.set_result(None)
        return delivered

    async def send_and_wait(self, *args: Any, **kwargs: Any) -> None:
        await (await self.send(*args, **kwargs))

    def results(self) -> list[dict[str, Any]]:
        return [orjson.loads(value) for topic, value, _ in self.sent if topic == "batch.results"]


class OneFetch:
    """`tokens` as a consumer reads it: one fetch of `records`, then nothing; the
    persister is told to stop once it has committed them."""

    def __init__(self, persister: Persister, records: list[ConsumerRecord[bytes, bytes]]) -> None:
        self._persister, self._records, self.commits = persister, records, 0

    async def getmany(self, **_: Any) -> dict[Any, list[ConsumerRecord[bytes, bytes]]]:
        fetched, self._records = self._records, []
        return {"tokens-0": fetched} if fetched else {}

    async def commit(self) -> None:
        self.commits += 1
        self._persister.request_stop()

    def assignment(self) -> set[Any]:
        return set()


def batch_final(request_id: str, offset: int = 5, **changes: Any) -> ConsumerRecord[bytes, bytes]:
    fields = {"batch_id": "b1", "custom_id": request_id, "kind": "batch", "store": False}
    event = final(request_id).model_copy(update=fields | changes)
    value = orjson.dumps(event.model_dump())
    return ConsumerRecord("tokens", 0, offset, 0, 0, b"k", value, None, 1, len(value), [])


async def run_once(
    records: list[ConsumerRecord[bytes, bytes]], producer: TakingProducer
) -> tuple[OneFetch, StandInWriter]:
    persister = Persister(Settings())
    real_producer, real_consumer = persister._producer, persister._consumer
    fetch, writer = OneFetch(persister, records), StandInWriter()
    persister._consumer, persister._producer = fetch, producer  # type: ignore[assignment]
    persister._writer = writer  # type: ignore[assignment]
    try:
        await asyncio.wait_for(persister.run(), 30)
    finally:
        await real_producer.stop()
        await real_consumer.stop()
    return fetch, writer


async def test_a_batch_final_no_result_can_be_made_of_does_not_stop_persistence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A forged final (token counts whose sum passes 64 bits) is dead-lettered by the store; its
    result could not be serialized, and persistence raised before its commit, on every
    restart. The other line's result goes out, and the fetch is committed."""
    monkeypatch.setattr("consumers.persist.SEND_RETRY_S", 0.0)
    huge = Usage(prompt_tokens=2**63, completion_tokens=2**63, queue_ms=0, decode_ms=0)
    forged = batch_final("poison", usage=huge)
    producer = TakingProducer()
    fetch, _ = await run_once([forged, batch_final("good", offset=6)], producer)
    assert fetch.commits >= 1
    assert [r["custom_id"] for r in producer.results()] == ["good"]
    assert [topic for topic, *_ in producer.sent].count("dead-letter") == 1


async def test_a_result_too_big_for_kafka_is_answered_with_an_error_in_its_place() -> None:
    """Kafka refuses a record over its size limit every time: the send was retried each
    second for good, and nothing more was stored."""
    producer = TakingProducer(limit=20_000)
    fetch, _ = await run_once([batch_final("big", text="x" * 30_000)], producer)
    assert fetch.commits >= 1
    [result] = producer.results()
    assert result["custom_id"] == "big" and result["response"] is None
    assert result["error"]["code"] == "result_too_large"


async def test_a_dead_letter_too_big_for_kafka_is_sent_without_its_value() -> None:
    """Its headers say where the original is; the value is left out."""
    persister = Persister(Settings())
    real = persister._producer
    producer = TakingProducer(limit=1_000)
    persister._producer = producer  # type: ignore[assignment]
    big = ConsumerRecord("tokens", 2, 9, 0, 0, b"k", b"v" * 5_000, None, 1, 5_000, [])
    try:
        assert await asyncio.wait_for(persister._dead_letter(big, "refused by the store"), 30)
    finally:
        await real.stop()
        await persister._consumer.stop()
    [(topic, value, headers)] = producer.sent
    assert topic == "dead-letter" and value == b""
    assert b"too large" in dict(headers)["error"]


class Behind(OneFetch):
    """The fetch, with 60 records still to read behind it."""

    def assignment(self) -> set[Any]:
        return {"tokens-0"}

    def highwater(self, _: Any) -> int:
        return 100

    async def position(self, _: Any) -> int:
        return 40


class RefusingProducer(TakingProducer):
    """`batch.results` unavailable (its leader moving) while `tokens` is read."""

    async def send(self, *args: Any, **kwargs: Any) -> asyncio.Future[None]:
        raise KafkaConnectionError("no leader for batch.results")


async def test_persistence_held_up_by_kafka_shows_on_its_metrics(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nothing is stored while a batch result cannot be sent: the lag gauge (set only
    after a commit) and every counter stood still, so the stall looked healthy."""
    monkeypatch.setattr("consumers.persist.SEND_RETRY_S", 0.01)
    persister = Persister(Settings())
    real_producer, real_consumer = persister._producer, persister._consumer
    persister._consumer = Behind(persister, [batch_final("held")])
    persister._producer = RefusingProducer()  # type: ignore[assignment]
    persister._writer = StandInWriter()  # type: ignore[assignment]
    running = asyncio.create_task(persister.run())
    try:
        failures = persister.metrics.send_failures._value.get
        await until(failures, lambda sent: sent >= 3, what="retried sends", idle_s=30, poll_s=0.01)
        assert persister.metrics.lag._value.get() == 60
    finally:
        persister.request_stop()
        await asyncio.gather(running, return_exceptions=True)
        await real_producer.stop()
        await real_consumer.stop()


class Rebalancing:
    """A consumer mid-rebalance: partition 0 revoked, 1 not positioned yet, 2 fine."""

    def assignment(self) -> set[Any]:
        return {("tokens", 0), ("tokens", 1), ("tokens", 2)}

    def highwater(self, tp: Any) -> int:
        return 50

    async def position(self, tp: Any) -> int:
        if tp[1] == 0:
            from aiokafka.errors import IllegalStateError

            raise IllegalStateError("No current assignment for partition")
        if tp[1] == 1:
            await asyncio.Event().wait()  # its committed offset never comes
        return 20


async def test_the_lag_metric_mid_rebalance_neither_raises_nor_waits() -> None:
    """It awaited every partition's position: a revoked one raised out of the loop and
    persist exited; one without a position held the whole loop for a metric."""
    persister = Persister(Settings())
    await persister._consumer.stop()  # never started: closed, swapped for the stand-in
    persister._consumer = Rebalancing()
    try:
        assert await asyncio.wait_for(persister._lag(), 30) == 30
    finally:
        await persister._producer.stop()
