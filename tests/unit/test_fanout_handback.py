"""A partition revoked and given back to the same gateway (an eager rebalance revokes
every partition, then hands most of them back): its open streams go on without a gap.

The group member, given the partition back, starts at its end; the hand-over reader
started at the revoke reads on from where each stream was. An event the member passed
on first made the hand-over's earlier ones look old, so they were dropped: the client's
text then waited for the final. Pure logic: the fan-out's own dispatch and hand-over,
fed by two stand-in readers in the order that broke it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import IllegalStateError, KafkaConnectionError
from aiokafka.structs import ConsumerRecord

import consumers.fanout as fanout_module
from consumers.fanout import Delivered, Subscription, TokenFanout
from schemas import topics
from schemas.codec import encode
from schemas.events import FinalEvent, TokenEvent, Usage
from tandoor.settings import Settings

REQUEST = "r_handback"
SENTINEL = "r_sentinel"  # another stream on the partition: its event marks what came first
PARTITION = 0
WAIT_S = 10  # a failure guard only: everything here is in memory


def record(
    offset: int, event: TokenEvent | FinalEvent, request_id: str = REQUEST
) -> ConsumerRecord[bytes, bytes]:
    key = request_id.encode()
    return ConsumerRecord(
        topics.TOKENS, PARTITION, offset, 0, 0, key, encode(event), None, 0, 0, ()
    )


def token(seq: int, request_id: str = REQUEST) -> TokenEvent:
    return TokenEvent(
        request_id=request_id, attempt=1, seq=seq, delta=f"t{seq} ", token_count=1, created_at_ms=1
    )


def final(seq: int) -> FinalEvent:
    return FinalEvent(
        request_id=REQUEST,
        attempt=1,
        seq=seq,
        finish_reason="stop",
        text="".join(f"t{i} " for i in range(seq)),
        usage=Usage(prompt_tokens=1, completion_tokens=seq, queue_ms=0, decode_ms=0),
        model="m",
        user_id="u",
        tier="free",
        conversation_id="c",
        created_at_ms=2,
        prompt_created_at_ms=1,
    )


class Feed:
    """Records handed out as the test releases them."""

    def __init__(self) -> None:
        self.records: asyncio.Queue[ConsumerRecord[bytes, bytes]] = asyncio.Queue()

    def __aiter__(self) -> Feed:
        return self

    async def __anext__(self) -> ConsumerRecord[bytes, bytes]:
        return await self.records.get()

    async def getmany(
        self, timeout_ms: int
    ) -> dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_ms / 1000):
                first = await self.records.get()
                rest = [self.records.get_nowait() for _ in range(self.records.qsize())]
                return {TopicPartition(topics.TOKENS, PARTITION): [first, *rest]}
        return {}


async def to_its_final(handover: Feed, carried: set[asyncio.Task[None]], tokens: int) -> None:
    """REQUEST's `tokens` events from offset 10 and its final, read by the hand-over
    readers `carried`, which close at the final."""
    for offset in range(10, 10 + tokens):
        handover.records.put_nowait(record(offset, token(offset - 10)))
    handover.records.put_nowait(record(10 + tokens, final(tokens)))
    async with asyncio.timeout(WAIT_S):
        await asyncio.gather(*carried)


def offsets(queue: asyncio.Queue[Delivered]) -> list[int]:
    return [queue.get_nowait().offset for _ in range(queue.qsize())]


@dataclass
class Rig:
    """A fan-out whose group member reads `group` and whose hand-over readers read
    `handover`, following REQUEST from offset 10."""

    fanout: TokenFanout
    group: Feed
    handover: Feed
    sub: Subscription
    started_at: list[int]  # where each hand-over reader started
    dispatch: asyncio.Task[None]


@contextlib.asynccontextmanager
async def dispatching(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Rig]:
    group, handover = Feed(), Feed()
    started_at: list[int] = []

    @contextlib.asynccontextmanager
    async def reader(_: object, partition: int, offset: int) -> AsyncIterator[Feed]:
        started_at.append(offset)
        yield handover

    monkeypatch.setattr(fanout_module, "partition_reader", reader)
    fanout = TokenFanout(Settings())
    unstarted, fanout._consumer = fanout._consumer, group
    sub = Subscription(REQUEST, PARTITION, next_offset=10)
    fanout._subs[REQUEST] = sub
    dispatch = asyncio.create_task(fanout._dispatch())
    try:
        yield Rig(fanout, group, handover, sub, started_at, dispatch)
    finally:
        dispatch.cancel()
        await asyncio.gather(dispatch, return_exceptions=True)
        await unstarted.stop()


async def test_a_stream_on_a_partition_given_back_goes_on_without_a_gap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with dispatching(monkeypatch) as rig:
        fanout, group, handover, sub = rig.fanout, rig.group, rig.handover, rig.sub
        await fanout.on_partitions_revoked([TopicPartition(topics.TOKENS, PARTITION)])
        carried = set(fanout._handovers)
        sentinel = Subscription(SENTINEL, PARTITION, next_offset=0)  # opened after the revoke
        fanout._subs[SENTINEL] = sentinel
        # Given back: the member starts at the partition's end, past events 10-12 that
        # were written during the rebalance, and passes on 13 before the reader reads.
        group.records.put_nowait(record(13, token(3)))
        group.records.put_nowait(record(14, token(0, SENTINEL), SENTINEL))
        async with asyncio.timeout(WAIT_S):
            await sentinel.queue.get()  # the member has dealt with 13
        for offset in range(10, 14):
            handover.records.put_nowait(record(offset, token(offset - 10)))
        handover.records.put_nowait(record(14, final(4)))
        async with asyncio.timeout(WAIT_S):
            await asyncio.gather(*carried)  # the reader closes at the final
        assert rig.started_at == [10]
        assert offsets(sub.queue) == [10, 11, 12, 13, 14]  # every event once, in order
        assert not fanout.handovers
        group.records.put_nowait(record(15, token(9)))  # later events: the member's again
        async with asyncio.timeout(WAIT_S):
            assert (await sub.queue.get()).offset == 15


async def test_a_rebalance_while_a_stream_is_handed_over_starts_no_second_reader(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every rebalance revokes every partition (the eager protocol): each one started
    another reader for the streams already handed over, so a rolling restart piled up a
    Kafka consumer per open stream and rebalance on every replica until replies ended."""
    async with dispatching(monkeypatch) as rig:
        fanout, handover, sub = rig.fanout, rig.handover, rig.sub
        for _ in range(3):
            await fanout.on_partitions_revoked([TopicPartition(topics.TOKENS, PARTITION)])
        assert fanout.handovers == 1
        await to_its_final(handover, set(fanout._handovers), tokens=3)
        assert rig.started_at == [10]
        assert offsets(sub.queue) == [10, 11, 12, 13]
        assert not fanout.handovers


@pytest.mark.parametrize(
    "failure",
    [
        KafkaConnectionError("Unable to bootstrap from [('127.0.0.1', 9092)]"),
        OSError(24, "Too many open files"),  # not a KafkaError: the reader's task just ended
    ],
    ids=["kafka-unreachable", "no-file-descriptors"],
)
async def test_a_hand_over_reader_that_fails_to_start_is_started_again(
    monkeypatch: pytest.MonkeyPatch, failure: Exception
) -> None:
    """Kafka unreachable when the partition moved (often what moved it): the reader
    failed, silently, and its streams got nothing until their watch gave up (150 s)."""
    handover = Feed()
    started_at: list[int] = []

    @contextlib.asynccontextmanager
    async def reader(_: object, partition: int, offset: int) -> AsyncIterator[Feed]:
        started_at.append(offset)
        if len(started_at) == 1:
            raise failure
        yield handover

    monkeypatch.setattr(fanout_module, "partition_reader", reader)
    monkeypatch.setattr(fanout_module, "READER_RETRY_S", 0)
    fanout = TokenFanout(Settings())
    sub = Subscription(REQUEST, PARTITION, next_offset=10)
    fanout._subs[REQUEST] = sub
    try:
        await fanout.on_partitions_revoked([TopicPartition(topics.TOKENS, PARTITION)])
        await to_its_final(handover, set(fanout._handovers), tokens=4)
        assert started_at == [10, 10]
        assert offsets(sub.queue) == [10, 11, 12, 13, 14]
    finally:
        await fanout._consumer.stop()


def foreign(offset: int) -> ConsumerRecord[bytes, bytes]:
    """A record some other client wrote to `tokens`, keyed with bytes that are not UTF-8."""
    return ConsumerRecord(
        topics.TOKENS, PARTITION, offset, 0, 0, b"\xff\xfe", b"{}", None, 0, 0, ()
    )


async def test_a_record_keyed_with_bytes_that_are_not_utf8_is_passed_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Decoding its key stopped the replica's dispatch (a fatal exit: every stream on
    it cut) and a hand-over reader (its streams got nothing more)."""
    async with dispatching(monkeypatch) as rig:
        rig.group.records.put_nowait(foreign(10))
        rig.group.records.put_nowait(record(11, token(0)))
        async with asyncio.timeout(WAIT_S):
            assert (await rig.sub.queue.get()).offset == 11
        await rig.fanout.on_partitions_revoked([TopicPartition(topics.TOKENS, PARTITION)])
        carried = set(rig.fanout._handovers)
        rig.handover.records.put_nowait(foreign(12))
        rig.handover.records.put_nowait(record(13, final(1)))
        async with asyncio.timeout(WAIT_S):
            await asyncio.gather(*carried)
        assert offsets(rig.sub.queue) == [13]
        assert not rig.dispatch.done()


async def test_an_earlier_subscriptions_end_leaves_a_later_one_to_the_same_id() -> None:
    """A summary job's id is made from the turns it covers: a second job for the same
    turns subscribed under it, and the first one's end removed the second's (its
    events were dropped, its summary lost)."""
    fanout = TokenFanout(Settings())
    try:
        first = Subscription(REQUEST, PARTITION, next_offset=0)
        second = Subscription(REQUEST, PARTITION + 1, next_offset=0)
        fanout._subs[REQUEST] = first
        fanout._subs[REQUEST] = second  # as subscribe() does
        fanout.unsubscribe(first)
        assert fanout._subs[REQUEST] is second
        fanout.unsubscribe(second)
        assert REQUEST not in fanout._subs
    finally:
        await fanout._consumer.stop()


class RevokedMeanwhile:
    """A consumer whose partition was taken between the fan-out's check and its ask."""

    async def position(self, tp: TopicPartition) -> int:
        raise IllegalStateError(f"No current assignment for partition {tp}")


async def test_a_subscription_to_a_partition_revoked_meanwhile_is_not_routed() -> None:
    """aiokafka's IllegalStateError went up as a 500; the post's 503 with Retry-After is
    what a rebalance gets."""
    fanout = TokenFanout(Settings())
    never_started, fanout._consumer = fanout._consumer, RevokedMeanwhile()
    try:
        fanout._usable = [PARTITION]
        fanout._ready.set()
        with pytest.raises(fanout_module.NotRouting):
            await fanout.subscribe(REQUEST)
    finally:
        await never_started.stop()
