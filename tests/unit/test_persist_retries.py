"""How persistence retries a write, with a stand-in for its Cassandra writer (the real
one: tests/integration/test_persist.py): a final the store refuses is dead-lettered
after POISON_TRIES, one it cannot reach is retried for as long as it takes. Tries were
counted by offset alone, so a final sharing its offset with a poison one on another
partition was dead-lettered with it (its reply never stored)."""

from __future__ import annotations

from typing import Any

import pytest
from aiokafka.errors import KafkaConnectionError
from aiokafka.structs import ConsumerRecord
from cassandra.cluster import NoHostAvailable

from consumers.persist import POISON_TRIES, Persister
from schemas.events import FinalEvent
from tandoor.settings import Settings
from tests.unit.test_rollups import final_event

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
    assert stored and dead == [(0, 100)]
    assert writer.tries == {"poison": POISON_TRIES, "good": UNREACHABLE_TRIES + 1}


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
    persister._producer = flaky
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
