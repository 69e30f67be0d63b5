"""Taking prompts from `prompts.<model>`: band priority, bounded intake, safe commits.

The consumer group spreads every band over every worker (round-robin over the
partitions, with each band at least as wide as the worker count). A worker takes
only as many prompts as it has free slots; the scheduler decides which bands get
them; offsets are committed only below the lowest unfinished prompt.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from typing import TypeAlias

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor
from aiokafka.errors import IllegalStateError, KafkaError
from aiokafka.structs import ConsumerRecord

from schemas.topics import BandLayout, prompts_topic, worker_group
from tandoor.clients import group_members
from tandoor.offsets import OffsetTracker, commit_finished
from tandoor.settings import Settings
from workers.scheduler import BandScheduler

log = logging.getLogger(__name__)

Record: TypeAlias = ConsumerRecord[bytes, bytes]
LAG_REFRESH_S = 0.1  # backlog per band is only needed when bands compete for slots
IDLE_WAIT_MS = 100
FULL_POLL_S = 30.0  # while the engine is full, a poll that fetches nothing this often
BACKLOG_WHILE_FULL_S = 1.0  # what measuring the backlog may take then


class PromptIntake(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, settings: Settings, model: str) -> None:
        self.settings, self.model = settings, model
        self.topic = prompts_topic(model)
        slots = settings.models[model].max_num_seqs
        self.layout = BandLayout([(band.name, band.partitions) for band in settings.bands])
        self.scheduler = BandScheduler(
            [b.name for b in self.layout.ranges],
            settings.worker_band_reserve,
            slots,
            settings.kept_for_top(model),
        )
        self.held: dict[str, int] = defaultdict(int)  # prompts in flight per band
        self.offsets = OffsetTracker()
        # Records in flight (by id: the task handling each holds it) and their partitions,
        # while assigned: one taken before a revoke is not its partition's any more.
        self._taken_in: dict[int, tuple[str, int]] = {}
        self.consumer = AIOKafkaConsumer(
            bootstrap_servers=settings.kafka_bootstrap,
            group_id=worker_group(model),
            client_id=f"worker.{model}",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            fetch_max_wait_ms=settings.fetch_wait_ms,
            max_partition_fetch_bytes=256 * 1024,  # prefetch little: others may take the rest
            partition_assignment_strategy=(RoundRobinPartitionAssignor,),
        )
        self.backlog: dict[str, int] = {}
        self._lag_checked = 0.0
        self._outside: set[int] = set()  # partitions past every band, warned of

    async def start(self) -> None:
        self.consumer.subscribe([self.topic], listener=self)
        await self.consumer.start()

    async def stop(self) -> None:
        await self.commit()
        await self.consumer.stop()

    async def leave_for_others(self) -> bool:
        """A stopping worker's partitions, to the other workers of its group now, not
        once its grace period is over: new prompts on them waited it out (up to a
        minute in Kubernetes). What finished is committed; what still runs, the next
        owner fetches again and waits on its lease. False, and kept, with no other
        worker in the group (nobody would take them, and what finishes here could not
        be committed) or Kafka not answering."""
        # Asked with a short timeout: the grace period's wait starts after this.
        admin = AIOKafkaAdminClient(
            bootstrap_servers=self.settings.kafka_bootstrap, request_timeout_ms=5000
        )
        try:
            await admin.start()
            others = await group_members(admin, worker_group(self.model)) - 1
        except KafkaError as exc:
            log.info("the group's members unknown (%s): partitions kept while finishing", exc)
            return False
        finally:
            await admin.close()
        if others < 1:
            return False
        await self.on_partitions_revoked(list(self.consumer.assignment()))
        self.consumer.unsubscribe()  # sends LeaveGroup: the others rebalance at once
        return True

    async def take(self, free_slots: int) -> list[Record]:
        """Up to `free_slots` prompts, higher bands first, lower bands never starved."""
        try:
            return await self._take(free_slots)
        except IllegalStateError as exc:  # a rebalance moved partitions under our feet
            log.info("assignment changed while taking prompts (%s); retrying", exc)
            self._lag_checked = 0.0
            return []
        except KafkaError as exc:  # e.g. the broker restarts: wait, the client reconnects
            log.warning("taking prompts failed: %s; retrying", exc)
            await asyncio.sleep(0.5)
            return []

    async def _take(self, free_slots: int) -> list[Record]:
        self._resume()
        await self._refresh_backlog()
        plan = self.scheduler.plan(free_slots, self.backlog, self.held)
        if not plan:  # nothing known to wait: a long poll, wherever a prompt may go now
            headroom = self.scheduler.lower_headroom(self.held)
            anywhere = headroom is None or headroom >= free_slots
            partitions = self.consumer.assignment() if anywhere else self._top_band()
            if not partitions:
                await asyncio.sleep(IDLE_WAIT_MS / 1000)
                return []
            batch = await self.consumer.getmany(
                *partitions, timeout_ms=IDLE_WAIT_MS, max_records=free_slots
            )
            return self._taken(batch)
        records: list[Record] = []
        for band, count in plan.items():
            partitions = self._assigned_in(band)
            if partitions:
                try:
                    batch = await self.consumer.getmany(
                        *partitions, timeout_ms=IDLE_WAIT_MS // 10, max_records=count
                    )
                except KafkaError:
                    if not records:
                        raise
                    # Those taken already are counted in flight and hold their
                    # partitions' commits: dropped, they never ran, and nothing was
                    # committed past them until a restart.
                    log.info("fetching band %s failed; running the %d taken", band, len(records))
                    return records
                records += self._taken(batch)
        return records

    async def poll_while_full(self) -> None:
        """One poll that fetches nothing (every partition paused, one assigned meanwhile
        too), made while the engine is full, so that the backlog stays in Kafka for
        other workers and aiokafka does not leave the group: it does after
        `max_poll_interval_ms` (5 min) without a poll, and every slot busy that long is
        common on a slow CPU (32 replies of 1,000 tokens at 3 tokens/s each). Its poll
        returns at once (a poll cancelled midway leaves aiokafka counting it as under
        way, and its check off for good); the backlog is measured within a second."""
        self.consumer.pause(*self.consumer.assignment())
        try:
            batch = await self.consumer.getmany(timeout_ms=0)
        except KafkaError as exc:
            log.info("polling while full: %s", exc)
            return
        for tp, records in batch.items():  # fetched before its pause: fetch it again
            self.consumer.seek(tp, records[0].offset)
        try:  # for the lag gauge, which a full worker would leave as it filled up
            async with asyncio.timeout(BACKLOG_WHILE_FULL_S):  # a slot may free meanwhile
                await self._refresh_backlog()
        except (IllegalStateError, KafkaError, TimeoutError) as exc:
            log.info("backlog while full: %r", exc)

    def finished(self, record: Record, held: bool = True) -> None:
        # Taken before a revoke forgot its partition: fetched again since, that copy's
        # offset is the copy's to finish (which may still have to run).
        if self._taken_in.pop(id(record), None) is not None:
            self.offsets.finished(record.topic, record.partition, record.offset)
        if held:
            self.held[self.band_of(record)] -= 1

    def copy_of_running(self, record: Record) -> None:
        """`record` was fetched again while it runs here (a rebalance): not in flight
        twice, or its band's count keeps lower bands from free slots until it ends."""
        self.held[self.band_of(record)] -= 1

    def running_again(self, record: Record) -> None:
        """The copy runs after all (its original did not answer): in flight again."""
        self.held[self.band_of(record)] += 1

    async def commit(self) -> None:
        await commit_finished(self.consumer, self.offsets)

    def band_of(self, record: Record) -> str:
        return self._band_of(record.partition)

    def _band_of(self, partition: int) -> str:
        """A partition past every band (the topic grew for a wider band before this
        worker's settings did) is read as the lowest band's: served, last."""
        try:
            return self.layout.band_of(partition).name
        except ValueError:
            if partition not in self._outside:
                self._outside.add(partition)
                log.warning(
                    "%s partition %d is outside every configured band: read as the lowest "
                    "band until this worker gets the new bands",
                    self.topic,
                    partition,
                )
            return self.layout.ranges[-1].name

    # ConsumerRebalanceListener
    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        await self.commit()
        gone = [(tp.topic, tp.partition) for tp in revoked]
        self.offsets.forget(gone)
        self._taken_in = {r: key for r, key in self._taken_in.items() if key not in gone}

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        log.info("assigned %s partitions %s", self.topic, sorted(tp.partition for tp in assigned))
        self._lag_checked = 0.0

    def _taken(self, batch: dict[TopicPartition, list[Record]]) -> list[Record]:
        records = [record for chunk in batch.values() for record in chunk]
        for record in records:
            self.offsets.taken(record.topic, record.partition, record.offset)
            self._taken_in[id(record)] = (record.topic, record.partition)
            band = self.band_of(record)
            self.backlog[band] = max(0, self.backlog.get(band, 0) - 1)
            self.held[band] += 1
        return records

    def _resume(self) -> None:
        """Whatever the consumer holds paused, not what a flag says: aiokafka sets a new
        assignment, then awaits a task before it calls the listener, and a full worker's
        poll in between paused the new partitions after the flag was last cleared (the
        worker took nothing until the next rebalance)."""
        if paused := self.consumer.paused():
            self.consumer.resume(*paused)

    def _top_band(self) -> list[TopicPartition]:
        return self._assigned_in(self.layout.ranges[0].name)

    def _assigned_in(self, band: str) -> list[TopicPartition]:
        return [tp for tp in self.consumer.assignment() if self._band_of(tp.partition) == band]

    async def _refresh_backlog(self) -> None:
        """Prompts waiting per band: the end of each partition minus our position."""
        if time.monotonic() - self._lag_checked < LAG_REFRESH_S:
            return
        self._lag_checked = time.monotonic()
        assigned = list(self.consumer.assignment())
        backlog = {band.name: 0 for band in self.layout.ranges}  # a band moved away reads 0
        ends = await self.consumer.end_offsets(assigned) if assigned else {}
        for tp in assigned:
            position = await self.consumer.position(tp)
            backlog[self._band_of(tp.partition)] += max(0, ends[tp] - position)
        self.backlog = dict(backlog)
