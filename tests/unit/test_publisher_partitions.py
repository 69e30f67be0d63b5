"""The reply partition a prompt names, as the worker's producer sends to it: a partition
`tokens` grew is looked up once more, one that does not exist gives way to the key's
hash, and is not looked up again for every token event (workers/publisher.py). Pure
logic: a stand-in producer that knows some partitions."""

from __future__ import annotations

from typing import Any, cast

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
