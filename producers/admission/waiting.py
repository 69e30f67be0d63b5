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
    lines and bytes each partition holds: its part of the read-ahead buffer, counted as
    lines come and go (counting them on every read cost ~0.1 s a second with the buffer
    full)."""

    def __init__(self) -> None:
        self._positions: dict[str, tuple[str, int]] = {}  # request id: (position, size)
        self.per_partition: Counter[int] = Counter()
        self.bytes_per_partition: Counter[int] = Counter()

    def add(self, request_id: str, position: str, size: int = 0) -> None:
        self.discard(request_id)
        self._positions[request_id] = (position, size)
        self.per_partition[_partition(position)] += 1
        self.bytes_per_partition[_partition(position)] += size

    def where(self, request_id: str) -> str | None:
        found = self._positions.get(request_id)
        return found[0] if found is not None else None

    def discard(self, request_id: str) -> None:
        found = self._positions.pop(request_id, None)
        if found is not None:
            position, size = found
            self.per_partition[_partition(position)] -= 1
            self.bytes_per_partition[_partition(position)] -= size

    def pause_full(
        self, consumer: AIOKafkaConsumer, max_waiting: int, max_waiting_bytes: int
    ) -> None:
        """A partition whose lines fill its share of the buffer, in lines or in bytes, is
        read no further until they move on; the others are read on. One tenant held by
        its quota (or a slow model) holds back only the batches that share its
        partition, not every batch; long-context lines cannot fill the memory."""
        assigned = consumer.assignment()
        if not assigned:
            return
        share = max(1, max_waiting // len(assigned))
        byte_share = max(1, max_waiting_bytes // len(assigned))
        full = {
            tp
            for tp in assigned
            if self.per_partition[tp.partition] >= share
            or self.bytes_per_partition[tp.partition] >= byte_share
        }
        paused = consumer.paused() & assigned
        if full - paused:
            log.info("buffer share full: pausing %s", sorted(tp.partition for tp in full - paused))
            consumer.pause(*(full - paused))
        if paused - full:
            consumer.resume(*(paused - full))

    def drop_partitions(self, gone: set[int]) -> None:
        """Forget the lines of partitions that moved: their new owner reads them again."""
        for request_id, (position, _) in list(self._positions.items()):
            if _partition(position) in gone:
                self.discard(request_id)

    def __len__(self) -> int:
        return len(self._positions)


def _partition(position: str) -> int:
    return int(position.partition(":")[0])
