"""Commit positions for out-of-order completion: the lowest unfinished offset wins."""

from __future__ import annotations

import heapq
import logging
from collections import Counter

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import CommitFailedError, KafkaError

log = logging.getLogger(__name__)


class PartitionOffsets:
    """Offsets taken from one partition; which are finished, which position is safe."""

    def __init__(self) -> None:
        self._pending: list[int] = []  # min-heap of unfinished offsets
        # The same, counted to look up (admission holds 50,000): one offset may be
        # taken twice at once (a rebalance fetched it again while it ran).
        self._unfinished: Counter[int] = Counter()
        self._finished: Counter[int] = Counter()  # copies of one offset each count
        self._next = -1  # one past the highest offset taken

    def taken(self, offset: int) -> None:
        heapq.heappush(self._pending, offset)
        self._unfinished[offset] += 1
        self._next = max(self._next, offset + 1)

    def finished(self, offset: int) -> None:
        if not self._unfinished[offset]:  # a second copy's (a rebalance fetched it twice)
            return  # kept, it would later pass for the same offset taken again, running
        self._unfinished[offset] -= 1
        if not self._unfinished[offset]:
            del self._unfinished[offset]
        self._finished[offset] += 1
        while self._pending and self._finished[self._pending[0]]:
            popped = heapq.heappop(self._pending)
            self._finished[popped] -= 1
            if not self._finished[popped]:
                del self._finished[popped]

    def committable(self) -> int | None:
        """The offset to commit: everything below it is finished. None if nothing taken."""
        if self._pending:
            return self._pending[0]
        return self._next if self._next >= 0 else None

    @property
    def in_flight(self) -> int:
        return len(self._pending)


class OffsetTracker:
    """PartitionOffsets for every partition a worker holds, keyed by (topic, partition)."""

    def __init__(self) -> None:
        self._partitions: dict[tuple[str, int], PartitionOffsets] = {}
        self._committed: dict[tuple[str, int], int] = {}

    def taken(self, topic: str, partition: int, offset: int) -> None:
        self._partitions.setdefault((topic, partition), PartitionOffsets()).taken(offset)

    def finished(self, topic: str, partition: int, offset: int) -> None:
        """A prompt from a partition since revoked is its new owner's to commit."""
        offsets = self._partitions.get((topic, partition))
        if offsets is not None:
            offsets.finished(offset)

    def to_commit(self) -> dict[tuple[str, int], int]:
        """Positions that moved since the last `committed` call."""
        moves = {}
        for key, offsets in self._partitions.items():
            position = offsets.committable()
            if position is not None and self._committed.get(key) != position:
                moves[key] = position
        return moves

    def committed(self, positions: dict[tuple[str, int], int]) -> None:
        self._committed.update(positions)

    def forget(self, keys: list[tuple[str, int]]) -> None:
        """Drop revoked partitions: their new owner starts from the committed position."""
        for key in keys:
            self._partitions.pop(key, None)
            self._committed.pop(key, None)


async def commit_finished(consumer: AIOKafkaConsumer, offsets: OffsetTracker) -> None:
    """Commit every partition's position below its oldest unfinished record. A commit
    that fails (a rebalance) is left to the rebalance listener, which commits again.
    A partition no longer assigned is forgotten, not committed: Kafka refuses the whole
    commit for it, and every later one while it is tracked."""
    moves = offsets.to_commit()
    assigned = {(tp.topic, tp.partition) for tp in consumer.assignment()}
    if gone := [key for key in moves if key not in assigned]:
        log.warning("not committing %s: no longer assigned", gone)
        offsets.forget(gone)
        moves = {key: position for key, position in moves.items() if key in assigned}
    if not moves:
        return
    try:
        await consumer.commit({TopicPartition(t, p): o for (t, p), o in moves.items()})
        offsets.committed(moves)
    except (CommitFailedError, KafkaError) as exc:
        log.warning("commit of %s failed: %s", moves, exc)
