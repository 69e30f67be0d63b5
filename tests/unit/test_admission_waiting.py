"""The count of waiting lines per partition that admission's buffer shares are read
from: kept as lines come and go, never drifting from the lines themselves."""

from __future__ import annotations

from typing import Any, cast

from aiokafka import TopicPartition

from producers.admission.waiting import WaitingLines
from schemas import topics


def test_counts_follow_lines_added_repeated_forwarded_and_revoked() -> None:
    lines = WaitingLines()
    lines.add("r-a", "0:10")
    lines.add("r-b", "0:11")
    lines.add("r-c", "3:7")
    lines.add("r-a", "0:10")  # read again (a replay): one line, not two
    assert (lines.per_partition[0], lines.per_partition[3], len(lines)) == (2, 1, 3)
    lines.discard("r-b")  # forwarded
    lines.discard("r-b")  # and again: no effect
    assert lines.per_partition[0] == 1 and lines.where("r-b") is None
    lines.drop_partitions({0})  # revoked: the new owner reads it again
    assert lines.per_partition[0] == 0 and lines.where("r-a") is None
    assert lines.where("r-c") == "3:7" and len(lines) == 1


class Consumer:
    """The part of aiokafka's consumer pause_full uses: two partitions assigned."""

    def __init__(self) -> None:
        self.assigned = {TopicPartition(topics.BATCH_REQUESTS, p) for p in (0, 1)}
        self.paused_now: set[TopicPartition] = set()

    def assignment(self) -> set[TopicPartition]:
        return self.assigned

    def paused(self) -> set[TopicPartition]:
        return set(self.paused_now)

    def pause(self, *tps: TopicPartition) -> None:
        self.paused_now.update(tps)

    def resume(self, *tps: TopicPartition) -> None:
        self.paused_now.difference_update(tps)


def test_a_partition_is_paused_by_the_bytes_its_lines_hold_not_only_their_number() -> None:
    """Counted by lines only, 12,500 long-context lines of 290 KB each were 3.4 GiB of one
    partition's share: the replica was killed for memory, and the next one too."""
    lines, consumer = WaitingLines(), Consumer()
    for offset in range(3):
        lines.add(f"r-{offset}", f"0:{offset}", size=300_000)
    lines.add("r-small", "1:0", size=100)
    lines.pause_full(cast(Any, consumer), max_waiting=50_000, max_waiting_bytes=1_000_000)
    assert consumer.paused_now == {TopicPartition(topics.BATCH_REQUESTS, 0)}  # 900 KB of 500
    lines.discard("r-0")
    lines.discard("r-1")
    lines.pause_full(cast(Any, consumer), max_waiting=50_000, max_waiting_bytes=1_000_000)
    assert consumer.paused_now == set() and lines.bytes_per_partition[0] == 300_000
