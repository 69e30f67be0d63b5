"""The lines admission has read and not yet forwarded or answered."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer

from schemas.events import PromptRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Waiting:
    """A checked line waiting for room in its model's batch band."""

    partition: int
    offset: int
    prompt: PromptRequest
    key: str | None = None  # the API key it came with, checked again when its turn comes

    @property
    def position(self) -> str:
        return f"{self.partition}:{self.offset}"


class WaitingLines:
    """Where each waiting line was read ("partition:offset", by request id), and how many
    each partition holds: its part of the read-ahead buffer, counted as lines come and
    go (counting them on every read cost ~0.1 s a second with the buffer full)."""

    def __init__(self) -> None:
        self._positions: dict[str, str] = {}
        self.per_partition: Counter[int] = Counter()

    def add(self, request_id: str, position: str) -> None:
        self.discard(request_id)
        self._positions[request_id] = position
        self.per_partition[_partition(position)] += 1

    def where(self, request_id: str) -> str | None:
        return self._positions.get(request_id)

    def discard(self, request_id: str) -> None:
        position = self._positions.pop(request_id, None)
        if position is not None:
            self.per_partition[_partition(position)] -= 1

    def pause_full(self, consumer: AIOKafkaConsumer, max_waiting: int) -> None:
        """A partition whose lines fill its share of the buffer is read no further until
        they move on; the others are read on. One tenant held by its quota (or a slow
        model) holds back only the batches that share its partition, not every batch."""
        assigned = consumer.assignment()
        if not assigned:
            return
        share = max(1, max_waiting // len(assigned))
        full = {tp for tp in assigned if self.per_partition[tp.partition] >= share}
        paused = consumer.paused() & assigned
        if full - paused:
            log.info("buffer share full: pausing %s", sorted(tp.partition for tp in full - paused))
            consumer.pause(*(full - paused))
        if paused - full:
            consumer.resume(*(paused - full))

    def drop_partitions(self, gone: set[int]) -> None:
        """Forget the lines of partitions that moved: their new owner reads them again."""
        for request_id, position in list(self._positions.items()):
            if _partition(position) in gone:
                self.discard(request_id)

    def __len__(self) -> int:
        return len(self._positions)


def _partition(position: str) -> int:
    return int(position.partition(":")[0])
