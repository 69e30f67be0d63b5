"""Queuing a batch's lines as one Kafka transaction, with stand-ins for the producer and
the store: a Kafka that never answers is a bounded wait, not a create that hangs, and a
batch queued is marked so even when the store fails at that moment."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest
from aiokafka.errors import KafkaTimeoutError
from cassandra.cluster import NoHostAvailable

from producers.batch_topic import send_all_or_none
from producers.gateway.batches.service import BatchService


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
    await asyncio.wait_for(asyncio.gather(*service._marking), 5)
    assert store.tries == ["b1", "b1", "b1"]
