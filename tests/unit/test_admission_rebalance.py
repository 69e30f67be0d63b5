"""Admission's reading, with stand-ins for its consumer and reader (the real ones:
tests/integration/test_batch_admission.py and test_batch_topic_hostile.py).

Through a rebalance (members joining and leaving mid-batch): aiokafka reports the old
assignment until the new one is agreed, so the records of a batch read before a revoke
looked still ours. Taken after the revoke had forgotten their partition, they were
tracked for a partition gone to another member (whose commits Kafka then refused) or,
when it came back, taken twice (one of them never finished: no commit past it again)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, cast

from aiokafka import TopicPartition
from aiokafka.errors import IllegalStateError
from aiokafka.structs import ConsumerRecord

from producers.admission.role import Admission
from producers.admission.unreadable import UnreadableRecords
from producers.admission.waiting import Waiting
from schemas import topics
from tandoor.partition_reader import PartitionReader
from tandoor.settings import Settings
from tests.unit.test_admission_forward import (
    AdmitsAll,
    NothingCancelled,
    OneTopicUnwritable,
    Valid,
    _none,
    batch_prompt,
)

TPS = {TopicPartition(topics.BATCH_REQUESTS, p) for p in (0, 1)}


class StandInConsumer:
    def __init__(
        self, positions: dict[int, int] | None = None, committed: dict[int, int] | None = None
    ) -> None:
        self.commits: list[dict[TopicPartition, int]] = []
        self.positions = positions or {}  # by partition; unset: reset to the commit (0)
        self.committed_offsets = committed or {}  # by partition; unset: none
        self.seeks: dict[int, int] = {}

    async def committed(self, tp: TopicPartition) -> int | None:
        return self.committed_offsets.get(tp.partition)

    async def position(self, tp: TopicPartition) -> int:
        if self.positions.get(tp.partition) == -1:  # moved again while it was fetched
            raise IllegalStateError("No current assignment for partition")
        return self.positions.get(tp.partition, 0)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.seeks[tp.partition] = offset

    def assignment(self) -> set[TopicPartition]:
        return TPS  # the old assignment, as until the rebalance completes

    def paused(self) -> set[TopicPartition]:
        return set()

    async def commit(self, offsets: dict[TopicPartition, int]) -> None:
        self.commits.append(offsets)


def record(partition: int, offset: int) -> ConsumerRecord[bytes, bytes]:
    return ConsumerRecord(
        topics.BATCH_REQUESTS, partition, offset, 0, 0, b"b", b"{}", None, 1, 2, [(b"h", b"v")]
    )


Admit = Callable[[ConsumerRecord[bytes, bytes], int], Awaitable[None]]


async def one_read(
    admission: Admission,
    consumer: StandInConsumer,
    batch: list[ConsumerRecord[bytes, bytes]],
    admit: Admit,
    revoke_in_read: bool = False,
) -> None:
    """One pass of admission's read loop over `batch`, with these stand-ins; a revoke of
    every partition inside the read when asked (a rebalance that completes meanwhile)."""

    class OneBatch:
        async def read(self, max_records: int, idle_s: float) -> list[Any]:
            admission.request_stop()  # one pass of the loop
            if revoke_in_read:
                await admission.on_partitions_revoked(list(TPS))
            return batch

        unread = PartitionReader(cast(Any, consumer), cast(Any, None)).unread

    await admission.consumer.stop()  # never started: closed for its finalizer
    admission.consumer = cast(Any, consumer)
    admission.reader = cast(Any, OneBatch())
    admission._admit = admit  # type: ignore[method-assign,assignment]
    try:
        await admission._read_lines()
    finally:
        await admission.producer.stop()  # never started: closed for its finalizer


async def test_records_read_before_a_revoke_are_left_to_be_read_again() -> None:
    admission = Admission(Settings())
    admitted: list[int] = []

    async def admit(line: ConsumerRecord[bytes, bytes], read_in: int = 0) -> None:
        admitted.append(line.offset)
        if len(admitted) == 1:  # a member joins while the first line is checked
            await admission.on_partitions_revoked(list(TPS))

    consumer = StandInConsumer()
    await one_read(admission, consumer, [record(0, 10), record(0, 11), record(1, 20)], admit)
    assert admitted == [10]
    assert admission.offsets.to_commit() == {}, "the rest is the next owner's to read"
    assert consumer.seeks == {}, "positions reset to the commit read them again already"


async def test_records_fetched_after_a_rebalance_completed_are_read_again() -> None:
    """The rebalance completed inside the read (stepping over an unreadable record waits
    a second per record): what came back was fetched under the new assignment, so the
    consumer's position was already past it. Thrown away as read before the revoke, those
    lines were never read again, and the next commit passed them: lost."""
    admission = Admission(Settings())
    admitted: list[int] = []

    async def admit(line: ConsumerRecord[bytes, bytes], read_in: int = 0) -> None:
        admitted.append(line.offset)

    consumer = StandInConsumer(positions={0: 12, 1: 21})
    batch = [record(0, 10), record(0, 11), record(1, 20)]
    await one_read(admission, consumer, batch, admit, revoke_in_read=True)
    assert admitted == []
    assert consumer.seeks == {0: 10, 1: 20}, "read again from the first thrown away"


async def test_lines_another_member_handled_meanwhile_are_not_read_again() -> None:
    """Revoked, handled and committed by another member up to 100, then back: the
    position is the commit, and the lines thrown away (from 50) are that member's done."""
    admission = Admission(Settings())

    async def admit(line: ConsumerRecord[bytes, bytes], read_in: int = 0) -> None:
        raise AssertionError("nothing is admitted after the revoke")

    consumer = StandInConsumer(positions={0: 100, 1: 130}, committed={0: 100, 1: 120})
    batch = [record(0, 50), record(1, 110)]
    await one_read(admission, consumer, batch, admit, revoke_in_read=True)
    assert consumer.seeks == {1: 120}, "from the commit, where fetched past it"


async def test_a_partition_moved_again_while_its_lines_are_given_back_stops_nothing() -> None:
    """Its position asked for while a second rebalance took it: aiokafka's error
    escaped the read loop and stopped admission (rolling deploys)."""
    admission = Admission(Settings())

    async def admit(line: ConsumerRecord[bytes, bytes], read_in: int = 0) -> None:
        raise AssertionError("nothing is admitted after the revoke")

    consumer = StandInConsumer(positions={0: -1, 1: 21})
    batch = [record(0, 10), record(1, 20)]
    await one_read(admission, consumer, batch, admit, revoke_in_read=True)
    assert consumer.seeks == {1: 20}


class StandInProducer:
    def __init__(self) -> None:
        self.letters: list[dict[str, bytes]] = []

    async def send_and_wait(self, topic: str, value: bytes, **kwargs: Any) -> None:
        self.letters.append(dict(kwargs["headers"]))


async def stepping_over(admission: Admission, read_with_it: list[Any]) -> StandInProducer:
    """One read of the admission's loop that steps over an unreadable record at offset 5
    of partition 0, returning `read_with_it`; the dead-letter producer it wrote to."""
    dead_letters = StandInProducer()

    class SteppingOver:
        async def read(self, max_records: int, idle_s: float) -> list[Any]:
            admission.request_stop()
            tp = TopicPartition(topics.BATCH_REQUESTS, 0)
            await admission.unreadable.dead_letter(tp, 5, "a header name that is not UTF-8")
            return read_with_it

    await admission.consumer.stop()  # never started: closed for their finalizers
    await admission.producer.stop()
    admission.consumer = cast(Any, StandInConsumer())
    admission.unreadable = UnreadableRecords(
        cast(Any, dead_letters), admission.offsets, admission.metrics
    )
    admission.reader = cast(Any, SteppingOver())
    await admission._read_lines()
    return dead_letters


async def test_an_unreadable_record_is_committed_past_only_with_the_records_before_it() -> None:
    """Dead-lettered, it is marked handled: as a partition's last record it was read and
    dead-lettered again after every restart. But only once the records read with it
    (those before it) are taken: marked at once, a commit meanwhile passed them too."""
    admission = Admission(Settings())
    commits_seen: list[dict[tuple[str, int], int]] = []

    async def admit(line: ConsumerRecord[bytes, bytes], read_in: int = 0) -> None:
        commits_seen.append(admission.offsets.to_commit())  # what a commit now would pass
        admission._done(line.partition, line.offset, "forwarded")

    admission._admit = admit  # type: ignore[method-assign,assignment]
    read_with_it = [record(1, 10), record(0, 3), record(0, 4)]  # 3 and 4 read before it
    assert len((await stepping_over(admission, read_with_it)).letters) == 1
    partition_0 = (topics.BATCH_REQUESTS, 0)
    # While partition 1's line was checked, 3 and 4 were read and not yet taken.
    assert partition_0 not in commits_seen[0], commits_seen
    assert admission.offsets.to_commit()[partition_0] == 6


async def test_an_unreadable_last_record_dead_lettered_is_committed_past() -> None:
    """It was never marked handled: as the partition's last record, the commit stayed
    below it, and every restart read it and dead-lettered it again."""
    admission = Admission(Settings())
    assert len((await stepping_over(admission, [])).letters) == 1
    assert admission.offsets.to_commit() == {(topics.BATCH_REQUESTS, 0): 6}


async def test_a_revoke_forgets_the_charges_its_waiting_lines_kept() -> None:
    """A line Kafka refused keeps its charge for its retry (and a line too large its 413)
    in memory. Revoked meanwhile, the line left its queue, and those entries stayed for
    the process's life: one per such line at every rebalance."""
    admission = Admission(Settings())
    prompt = batch_prompt(admission)
    admission.submitter = cast(Any, OneTopicUnwritable(prompt.model))
    admission.marks = cast(Any, NothingCancelled())
    admission.quotas, admission.callers = cast(Any, AdmitsAll()), cast(Any, Valid())
    admission._why_unrun = lambda waiting: _none()  # type: ignore[method-assign]
    queue = admission.queues[prompt.model]
    admission.queued.add(prompt.request_id, "0:3")
    try:
        assert not await admission._forward(queue, "u", Waiting(0, 3, prompt))
        assert prompt.request_id in admission._charged, "kept for its retry"
        admission._too_large["bl_other"] = "too large"
        queue.push("u", Waiting(0, 4, prompt.model_copy(update={"request_id": "bl_other"})), 0)
        await admission.on_partitions_revoked([TopicPartition(topics.BATCH_REQUESTS, 0)])
    finally:
        await admission.consumer.stop()  # never started: closed for their finalizers
        await admission.producer.stop()
    assert queue.size == 0, "the new owner reads them again"
    assert admission._charged == {}
    assert admission._too_large == {}
