"""Admission's reading, with stand-ins for its consumer and reader (the real ones:
tests/integration/test_batch_admission.py and test_batch_topic_hostile.py).

Through a rebalance (members joining and leaving mid-batch): aiokafka reports the old
assignment until the new one is agreed, so the records of a batch read before a revoke
looked still ours. Taken after the revoke had forgotten their partition, they were
tracked for a partition gone to another member (whose commits Kafka then refused) or,
when it came back, taken twice (one of them never finished: no commit past it again)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, cast
from unittest.mock import patch

from aiokafka import TopicPartition
from aiokafka.errors import IllegalStateError
from aiokafka.structs import ConsumerRecord
from cassandra.cluster import NoHostAvailable
from redis.exceptions import ConnectionError as RedisConnectionError

from producers.admission.role import Admission
from producers.admission.unreadable import UnreadableRecords
from producers.admission.waiting import Waiting
from schemas import topics
from schemas.events import PromptRequest
from tandoor.partition_reader import PartitionReader
from tandoor.policies.quota import charged
from tandoor.settings import Settings

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


def batch_prompt(admission: Admission) -> PromptRequest:
    return PromptRequest.model_validate(
        {
            "request_id": "bl_1",
            "model": admission.settings.served_models[0],
            "user_id": "u",
            "tier": "batch",
            "band": "batch",
            "conversation_id": "bl_1",
            "messages": [{"role": "user", "content": "Hi"}],
            "sampling": {"max_tokens": 4},
            "created_at_ms": 1,
            "batch_id": "b1",
            "custom_id": "line-0",
        }
    )


class StandInMarks:
    async def cancelled(self, owner: str, batch_id: str | None) -> bool:
        return True

    async def mark(self, request_id: str, position: str, first_only: bool = False) -> None:
        return None


class CassandraDown:
    async def unrun(self, prompt: Any, why: str) -> None:
        raise NoHostAvailable("Cassandra is unreachable", {})


async def test_a_store_down_ends_the_sweep_of_cancelled_lines_not_the_forwarding() -> None:
    """The sweep answering a cancelled batch's waiting lines retried each one until the
    store answered: forwarding, every model's, stopped meanwhile (it needs Redis and
    Kafka only)."""
    admission = Admission(Settings())
    prompt = batch_prompt(admission)
    admission.marks = cast(Any, StandInMarks())
    admission.answers = cast(Any, CassandraDown())
    admission.queued.add(prompt.request_id, "0:3")
    admission.queues[prompt.model].push("u", Waiting(0, 3, prompt))
    try:
        await asyncio.wait_for(admission._answer_unrunnable(), 5)
    finally:
        await admission.consumer.stop()  # never started: closed for their finalizers
        await admission.producer.stop()
    assert admission.queues[prompt.model].size == 1, "left for the next sweep"


async def test_an_unreadable_last_record_dead_lettered_is_committed_past() -> None:
    """It was never marked handled: as the partition's last record, the commit stayed
    below it, and every restart read it and dead-lettered it again."""
    admission = Admission(Settings())
    assert len((await stepping_over(admission, [])).letters) == 1
    assert admission.offsets.to_commit() == {(topics.BATCH_REQUESTS, 0): 6}


class MarkFailsOnce:
    def __init__(self) -> None:
        self.marked: list[str] = []

    async def mark(self, request_id: str, position: str, first_only: bool = False) -> None:
        if not self.marked:
            self.marked.append("failed")
            raise RedisConnectionError("Redis is unreachable")
        self.marked.append(position)


class Counting:
    def __init__(self) -> None:
        self.sent: list[str] = []

    async def submit(self, prompt: PromptRequest) -> None:
        self.sent.append(prompt.request_id)


class AdmitsAll:
    def __init__(self) -> None:
        self.refunded: list[str] = []

    async def admit(self, user_id: str, policy: Any, request_id: str, *_: Any, **__: Any) -> Any:
        return charged(user_id, request_id, 1, 0)

    async def refund(self, admission: Any) -> None:
        self.refunded.append(admission.request_id)


async def test_a_mark_that_fails_after_the_forward_does_not_forward_the_line_again() -> None:
    """The whole step was tried again: the line went to the model's topic twice (and,
    with Redis failing, no worker could tell the copies apart)."""
    admission = Admission(Settings())
    prompt = batch_prompt(admission)
    marks, submitter = MarkFailsOnce(), Counting()
    admission.marks, admission.submitter = cast(Any, marks), cast(Any, submitter)
    admission.quotas, admission.callers = cast(Any, AdmitsAll()), cast(Any, Valid())
    admission._answered_unrun = lambda waiting: _false()  # type: ignore[method-assign]
    admission.queued.add(prompt.request_id, "0:3")
    queue = admission.queues[prompt.model]
    try:
        with patch("producers.admission.role.RETRY_S", 0.01):
            forward = partial(admission._forward, queue, "u", Waiting(0, 3, prompt))
            assert await admission._until_done(forward)
    finally:
        await admission.consumer.stop()  # never started: closed for their finalizers
        await admission.producer.stop()
    assert submitter.sent == [prompt.request_id], "forwarded more than once"
    assert marks.marked == ["failed", "0:3"], "the mark was not written in the end"


async def _false() -> bool:
    return False


class Valid:
    async def resolve(self, key: str | None) -> object:
        return object()


class Revoked:
    async def resolve(self, key: str | None) -> None:
        return None  # the key was revoked while its line waited


class KeysUnreadable:
    async def resolve(self, key: str | None) -> None:
        raise NoHostAvailable("Cassandra is unreachable", {})


class Answers:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    async def send(self, owner: str | None, batch_id: str | None, output: dict[str, Any]) -> None:
        self.sent.append(output)


async def forward_once(
    callers: object, marks: object | None = None, submitter: Any = None
) -> tuple[Any, Answers, PromptRequest, Admission]:
    """One waiting line's turn to be forwarded, with these keys, marks and submitter."""
    admission = Admission(Settings())
    prompt = batch_prompt(admission)
    submitter, answers = submitter or Counting(), Answers()
    admission.marks = cast(Any, marks or StandInMarks())
    admission.submitter, admission.answers = cast(Any, submitter), cast(Any, answers)
    admission.quotas, admission.callers = cast(Any, AdmitsAll()), cast(Any, callers)
    admission._answered_unrun = lambda waiting: _false()  # type: ignore[method-assign]
    admission.queued.add(prompt.request_id, "0:3")
    try:
        with patch("producers.admission.role.RETRY_S", 0.01):
            forward = partial(
                admission._forward,
                admission.queues[prompt.model],
                "u",
                Waiting(0, 3, prompt, "tdr_key"),
            )
            await admission._until_done(forward)
    finally:
        await admission.consumer.stop()  # never started: closed for their finalizers
        await admission.producer.stop()
    return submitter, answers, prompt, admission


async def test_a_line_whose_key_was_revoked_while_it_waited_is_answered_401_not_run() -> None:
    """The key was checked once, when the line was read: lines held hours behind their
    tenant's quota ran (and were charged) under a key revoked meanwhile."""
    submitter, answers, prompt, admission = await forward_once(Revoked())
    assert submitter.sent == [], "it ran"
    (output,) = answers.sent
    assert output["response"]["status_code"] == 401 and output["custom_id"] == "line-0"
    assert admission.queued.where(prompt.request_id) is None


async def test_a_refusal_whose_mark_fails_is_sent_once() -> None:
    """The whole step was tried again, every second while Redis refused the mark (full):
    the same answer went out again and again."""
    _, answers, _, _ = await forward_once(Revoked(), MarkFailsOnce())
    assert len(answers.sent) == 1, answers.sent


async def test_a_key_that_cannot_be_read_again_does_not_stop_forwarding() -> None:
    """Cassandra down (the key's cache run out): the line is forwarded, as it was read
    with a good key; retried instead, it stopped forwarding for every model."""
    submitter, answers, prompt, _ = await forward_once(KeysUnreadable())
    assert submitter.sent == [prompt.request_id] and answers.sent == []


class NoOwner:
    async def resolve(self, key: str | None) -> None:
        return None

    async def revoked_owner(self, key: str | None) -> None:
        return None  # never a key of anyone's


class RecordingMarks:
    def __init__(self) -> None:
        self.marked: list[str] = []

    async def where(self, request_id: str) -> str | None:
        return None

    async def mark(self, request_id: str, position: str, first_only: bool = False) -> None:
        self.marked.append(position)


async def test_lines_with_no_ones_key_are_answered_but_leave_nothing_in_redis() -> None:
    """Anyone who can write to the topic, with no key at all, grew Redis by a mark kept
    7 days per line; under volatile-lru they pushed out quota windows and real marks."""
    admission = Admission(Settings())
    marks, answers = RecordingMarks(), Answers()
    admission.callers, admission.marks = cast(Any, NoOwner()), cast(Any, marks)
    admission.answers = cast(Any, answers)
    line = b'{"custom_id": "junk", "method": "POST", "url": "/v1/chat/completions", "body": {}}'
    junk = ConsumerRecord(
        topics.BATCH_REQUESTS, 0, 7, 0, 0, b"b1", line, None, 2, len(line), [("batch-id", b"b1")]
    )
    try:
        await admission._admit(junk, 0)
    finally:
        await admission.consumer.stop()  # never started: closed for their finalizers
        await admission.producer.stop()
    (output,) = answers.sent
    assert output["response"]["status_code"] == 401 and output["custom_id"] == "junk"
    assert marks.marked == []
