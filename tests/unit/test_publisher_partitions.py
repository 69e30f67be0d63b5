"""The reply partition a prompt names, as the worker's producer sends to it: a partition
`tokens` grew is looked up once more, one that does not exist gives way to the key's
hash, and is not looked up again for every token event; a final or usage record
Kafka refuses for a while is sent again (workers/publisher.py). Pure logic: a stand-in
producer that knows some partitions."""

from __future__ import annotations

from typing import Any, cast

import pytest
from aiokafka.errors import (
    KafkaTimeoutError,
    NotLeaderForPartitionError,
    TopicAuthorizationFailedError,
)

from tests.unit.test_rollups import final_event, usage
from workers.publisher import Publisher


class Metadata:
    def __init__(self, known: set[int], after_update: set[int]) -> None:
        self.known, self.after_update, self.updates = known, after_update, 0

    async def force_metadata_update(self) -> bool:
        self.updates += 1
        self.known = self.after_update
        return True


class Producer:
    def __init__(self, known: set[int], after_update: set[int]) -> None:
        self.client = Metadata(known, after_update)

    async def partitions_for(self, topic: str) -> set[int]:
        return self.client.known


async def test_a_partition_tokens_grew_is_found_after_one_lookup() -> None:
    producer = Producer({0, 1}, {0, 1, 2})
    publisher = Publisher(cast(Any, producer))
    assert await publisher._reply_partition(2) == 2
    assert await publisher._reply_partition(1) == 1
    assert producer.client.updates == 1


async def test_a_partition_that_does_not_exist_is_looked_up_once() -> None:
    producer = Producer({0, 1}, {0, 1})
    publisher = Publisher(cast(Any, producer))
    for _ in range(50):  # a forged prompt's token events
        assert await publisher._reply_partition(1_000_000) is None
    assert producer.client.updates == 1


class LeaderlessFor(Producer):
    """A producer whose partitions have no leader for its first `failures` sends."""

    def __init__(self, failures: int, error: type[Exception] = KafkaTimeoutError) -> None:
        super().__init__({0, 1}, {0, 1})
        self.failures, self.sent, self.error = failures, 0, error

    async def send_and_wait(self, topic: str, value: bytes, key: bytes, **_: Any) -> None:
        if self.failures:
            self.failures -= 1
            raise self.error()
        self.sent += 1


async def test_a_usage_record_kafka_refuses_is_sent_again_not_a_worker_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its final was out: the worker stopped, and each worker after it published the
    final again and stopped too, while the partition had no leader."""
    monkeypatch.setattr("workers.publisher.RESEND_AFTER_S", (0.0,))
    producer = LeaderlessFor(failures=3)
    await Publisher(cast(Any, producer)).usage(usage("r_1"))
    assert producer.sent == 1 and producer.failures == 0


async def test_a_usage_record_kafka_refuses_for_good_stops_the_worker() -> None:
    """No write permission on `usage` (ACLs added): retried, every reply's prompt stayed
    unfinished for good, and the workers stalled without a word."""

    class Forbidden(LeaderlessFor):
        async def send_and_wait(self, topic: str, value: bytes, key: bytes, **_: Any) -> None:
            raise TopicAuthorizationFailedError()

    with pytest.raises(TopicAuthorizationFailedError):
        await Publisher(cast(Any, Forbidden(failures=0))).usage(usage("r_1"))


async def test_a_final_kafka_refuses_for_a_while_is_sent_again_not_a_worker_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A `tokens` partition without a leader past the request timeout: the worker
    stopped, handing back every reply it ran, and so did each worker the prompt went to
    next (it found the final recorded, published it, failed) until the leader was back."""
    monkeypatch.setattr("workers.publisher.RESEND_AFTER_S", (0.0,))
    producer = LeaderlessFor(failures=3, error=NotLeaderForPartitionError)
    await Publisher(cast(Any, producer)).final(final_event("r_1", 1), 1)
    assert producer.sent == 1 and producer.failures == 0


async def test_a_final_kafka_refuses_past_its_tries_stops_the_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Retried for ever, each such reply held its engine slot and token budget: a worker
    full of them took no prompt at all, and said nothing."""
    monkeypatch.setattr("workers.publisher.RESEND_AFTER_S", (0.0,))
    monkeypatch.setattr("workers.publisher.FINAL_TRIES_S", 0.0)
    refused = LeaderlessFor(failures=2, error=NotLeaderForPartitionError)
    with pytest.raises(NotLeaderForPartitionError):
        await Publisher(cast(Any, refused)).final(final_event("r_1", 1), 1)
