from __future__ import annotations

from typing import cast

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import IllegalStateError

from tandoor.offsets import OffsetTracker, PartitionOffsets, commit_finished


def test_nothing_taken_nothing_to_commit() -> None:
    assert PartitionOffsets().committable() is None


def test_commit_waits_for_the_lowest_unfinished_offset() -> None:
    offsets = PartitionOffsets()
    for offset in (10, 11, 12, 13):
        offsets.taken(offset)
    offsets.finished(12)
    offsets.finished(11)
    assert offsets.committable() == 10  # 10 still runs: a crash must redeliver it
    offsets.finished(10)
    assert offsets.committable() == 13
    offsets.finished(13)
    assert offsets.committable() == 14
    assert offsets.in_flight == 0


def test_tracker_reports_only_moved_positions() -> None:
    tracker = OffsetTracker()
    tracker.taken("prompts.m", 0, 5)
    tracker.taken("prompts.m", 1, 7)
    tracker.finished("prompts.m", 1, 7)
    moves = tracker.to_commit()
    assert moves == {("prompts.m", 0): 5, ("prompts.m", 1): 8}
    tracker.committed(moves)
    assert tracker.to_commit() == {}
    tracker.finished("prompts.m", 0, 5)
    assert tracker.to_commit() == {("prompts.m", 0): 6}


def test_forgotten_partitions_are_not_committed() -> None:
    tracker = OffsetTracker()
    tracker.taken("t", 0, 1)
    tracker.forget([("t", 0)])
    assert tracker.to_commit() == {}


def test_a_prompt_from_a_revoked_partition_finishes_without_error() -> None:
    """A rebalance revokes the partition while its prompt still runs: finishing it must
    not fail the worker (it raised KeyError), and it is the new owner's to commit."""
    tracker = OffsetTracker()
    tracker.taken("prompts.m", 3, 40)
    tracker.taken("prompts.m", 4, 9)
    tracker.forget([("prompts.m", 3)])
    tracker.finished("prompts.m", 3, 40)
    tracker.finished("prompts.m", 4, 9)
    assert tracker.to_commit() == {("prompts.m", 4): 10}


class StandInConsumer:
    """What commit_finished uses of AIOKafkaConsumer; like aiokafka, it refuses a whole
    commit that names a partition not assigned."""

    def __init__(self, assigned: set[TopicPartition]) -> None:
        self.assigned = assigned
        self.commits: list[dict[TopicPartition, int]] = []

    def assignment(self) -> set[TopicPartition]:
        return self.assigned

    async def commit(self, offsets: dict[TopicPartition, int]) -> None:
        if unassigned := set(offsets) - self.assigned:
            raise IllegalStateError(f"Partitions {unassigned} are not assigned")
        self.commits.append(offsets)


async def test_a_partition_no_longer_assigned_does_not_stop_the_others_commits() -> None:
    """A record read before a rebalance and taken after it left its partition tracked:
    every later commit named it, Kafka refused each whole, and nothing was committed
    until a restart (which read everything since again)."""
    tracker = OffsetTracker()
    tracker.taken("t", 0, 5)
    tracker.finished("t", 0, 5)
    tracker.taken("t", 1, 9)  # its partition went to another member
    tracker.finished("t", 1, 9)
    consumer = StandInConsumer({TopicPartition("t", 0)})
    await commit_finished(cast(AIOKafkaConsumer, consumer), tracker)
    tracker.taken("t", 0, 6)
    tracker.finished("t", 0, 6)
    await commit_finished(cast(AIOKafkaConsumer, consumer), tracker)
    assert consumer.commits == [{TopicPartition("t", 0): 6}, {TopicPartition("t", 0): 7}]
    assert tracker.to_commit() == {}


def test_an_offset_finished_twice_does_not_pass_a_later_copy_of_it_still_running() -> None:
    """A rebalance fetched offset 5 again while it ran: both copies finish. Fetched a
    third time (another rebalance) and running, it must still hold the commit."""
    offsets = PartitionOffsets()
    offsets.taken(5)
    offsets.finished(5)
    offsets.finished(5)  # the copy, which waited for the original
    offsets.taken(5)
    offsets.taken(6)
    offsets.finished(6)
    assert offsets.committable() == 5
    offsets.finished(5)
    assert offsets.committable() == 7 and offsets.in_flight == 0


def test_two_copies_of_an_offset_taken_at_once_each_hold_the_commit() -> None:
    offsets = PartitionOffsets()
    for offset in (5, 5, 6):
        offsets.taken(offset)
    offsets.finished(6)
    offsets.finished(5)
    assert offsets.committable() == 5  # the other copy still runs
    offsets.finished(5)
    assert offsets.committable() == 7 and offsets.in_flight == 0
    for offset in (8, 9, 9):  # both copies finish before the offset below them
        offsets.taken(offset)
    offsets.finished(9)
    offsets.finished(9)
    offsets.finished(8)
    assert offsets.committable() == 10 and offsets.in_flight == 0, "stuck at 9"


class Compared(int):
    """An offset that counts how often it is compared."""

    comparisons = 0

    def __eq__(self, other: object) -> bool:
        Compared.comparisons += 1
        return int(self) == other

    def __lt__(self, other: int) -> bool:
        Compared.comparisons += 1
        return int(self) < other

    __hash__ = int.__hash__


def test_finishing_a_partitions_offsets_costs_linear_time_however_many_wait() -> None:
    """Admission holds every waiting line of a partition (50,000): each finish looked
    its offset up in the whole heap, and a cancelled batch held the loop for seconds."""
    offsets, many = PartitionOffsets(), 4_000
    taken = [Compared(offset) for offset in range(many)]
    for offset in taken:
        offsets.taken(offset)
    Compared.comparisons = 0
    for offset in reversed(taken):  # the newest first: none can be committed until the last
        offsets.finished(offset)
    assert offsets.committable() == many
    assert Compared.comparisons < 40 * many, Compared.comparisons  # a heap's log n each
