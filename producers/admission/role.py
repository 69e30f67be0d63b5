"""`tandoor admission`: batch lines from `batch.requests` into the batch band.

Any Kafka client writes OpenAI batch-input lines to `batch.requests`, keyed by a batch
id, with `authorization: Bearer <key>` (and optionally `batch-id`) headers. This role
- authenticates the key and checks each line as the HTTP API checks the same request;
  a bad key or a bad line gets an error result on `batch.results` and goes no further;
- queues good lines per tenant and forwards them with a Virtual Token Counter
  (fairness.py), only while the model's batch band holds fewer than
  `batch_backlog_per_worker` prompts per worker: a flood waits here, not in Kafka;
- charges each line to its tenant's quota as it forwards it (over quota, that tenant
  waits and the others go on); a waiting line of a cancelled batch, or past its
  batch's window, is answered within a second, not at its turn;
- commits a partition's offset only below its oldest line not yet forwarded or
  answered, and marks each handled line in Redis with where it was read, so after a
  crash the lines read again are skipped, not run twice;
- reads one partition at a time and steps over a record aiokafka cannot parse (a
  header name that is not UTF-8), noting it on the dead-letter topic
  (tandoor/partition_reader.py): one hostile producer stopped every batch.

Results of forwarded lines are published by the persistence consumer once stored.
Reading and checking are here; forwarding is forwarding.py, and the steps both share
(answering a line without running it, marking it, counting it done) line_steps.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from functools import partial
from typing import TypeAlias

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError
from aiokafka.structs import ConsumerRecord
from cassandra.cluster import Cluster

from producers.admission import line_steps
from producers.admission.answers import Answers
from producers.admission.band_room import BandRoom
from producers.admission.fairness import FairQueue
from producers.admission.forwarding import POLL_S, Forwarding
from producers.admission.headers import (
    BAD,
    batch_deadline_ms,
    bearer_token,
    check_batch_id,
    text_of,
)
from producers.admission.lines import Refused, parse_line, prompt_for
from producers.admission.marks import CallerCache, LineMarks
from producers.admission.metrics import AdmissionMetrics
from producers.admission.stored_cancels import StoredCancels
from producers.admission.unreadable import UnreadableRecords
from producers.admission.waiting import Waiting, WaitingLines
from producers.gateway.chat.checks import ReplyChecks
from producers.model_load import LoadMonitor
from producers.prompts import PromptSubmitter
from schemas import topics
from schemas.batch import (
    AUTHORIZATION_HEADER,
    BATCH_ID_HEADER,
    DEADLINE_HEADER,
    custom_line_request_id,
    refused_output,
)
from tandoor.clients import (
    cassandra_cluster,
    kafka_producer,
    redis_client,
)
from tandoor.offsets import OffsetTracker, commit_finished
from tandoor.ops import OpsServer
from tandoor.partition_reader import PartitionReader
from tandoor.policies.api_keys import KeyStore
from tandoor.policies.moderation import DefaultModerator
from tandoor.policies.quota import Admission as QuotaAdmission
from tandoor.policies.quota import Quotas
from tandoor.policies.redis_keys import quota_account
from tandoor.settings import Settings

log = logging.getLogger(__name__)

Record: TypeAlias = ConsumerRecord[bytes, bytes]
COMMIT_EVERY_S = 1.0
IDLE_S = 0.1  # nothing to read: look again after this


class Admission(Forwarding, ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.consumer = AIOKafkaConsumer(
            bootstrap_servers=settings.kafka_bootstrap,
            group_id=settings.admission_group,
            client_id="admission",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            fetch_max_wait_ms=settings.fetch_wait_ms,
            # An API batch's lines are one transaction: all run, or none (a gateway that
            # died part-way). Records written without one are read as they come.
            isolation_level="read_committed",
        )
        self.producer = kafka_producer(settings, "admission")
        self.submitter = PromptSubmitter(settings, self.producer)
        self.load = LoadMonitor(settings, poll_s=POLL_S)
        self.offsets = OffsetTracker()
        self.metrics = AdmissionMetrics()
        self.unreadable = UnreadableRecords(self.producer, self.offsets, self.metrics)
        self.reader = PartitionReader(self.consumer, self.unreadable.dead_letter)
        self.queues: dict[str, FairQueue[Waiting]] = {m: FairQueue() for m in settings.models}
        self.queued = WaitingLines()
        self.ops = OpsServer("admission", self.metrics.registry, self._readiness)
        self.band = BandRoom(settings, self.load)
        self._arrived = asyncio.Event()
        self._charged: dict[str, QuotaAdmission] = {}
        self._too_large: dict[str, str] = {}
        self._unwritable_until: dict[str, float] = {}
        self._revokes = 0  # a record read before the latest revoke is its new owner's
        self._stopping = asyncio.Event()
        self._cluster: Cluster | None = None
        self._redis: aioredis.Redis | None = None

    async def start(self) -> None:
        # Served first: liveness answers while it connects and joins (not ready yet).
        await self.ops.start(self.settings.host, self.settings.admission_metrics_port)
        self._cluster = cassandra_cluster(self.settings)
        session = await asyncio.to_thread(self._cluster.connect, self.settings.keyspace)
        self._redis = redis_client(self.settings)
        self.callers = CallerCache(KeyStore(session, self._redis, set(self.settings.tiers)))
        self.marks = LineMarks(self._redis, StoredCancels(session))
        self.answers = Answers(self.producer, session)
        self.quotas = Quotas(self._redis)
        self.checks = ReplyChecks(
            self.settings, DefaultModerator(self.settings.moderation_blocklist), self.quotas
        )
        await self.producer.start()
        self.consumer.subscribe([topics.BATCH_REQUESTS], listener=self)
        await self.consumer.start()
        await self.load.start()
        log.info("admission ready: %s -> batch band", topics.BATCH_REQUESTS)

    def request_stop(self) -> None:
        self._stopping.set()
        self._arrived.set()

    async def run(self) -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(self._read_lines(), name="read")
            group.create_task(self._forward_lines(), name="forward")
            group.create_task(self._commit_often(), name="commit")

    async def close(self) -> None:
        await self.ops.close()
        await self.load.stop()
        await self._commit()
        await self.consumer.stop()
        await self.producer.stop()
        if self._redis is not None:
            await self._redis.aclose()
        if self._cluster is not None:
            await asyncio.to_thread(self._cluster.shutdown)
            self._cluster = None

    # Reading and checking.

    async def _read_lines(self) -> None:
        while not self._stopping.is_set():
            limits = self.settings.admission_max_waiting, self.settings.admission_max_waiting_bytes
            self.queued.pause_full(self.consumer, *limits)
            read_in = self._revokes
            try:
                records = await self.reader.read(max_records=500, idle_s=IDLE_S)
            except KafkaError as exc:
                log.warning("reading %s failed: %s; retrying", topics.BATCH_REQUESTS, exc)
                await asyncio.sleep(line_steps.RETRY_S)
                continue
            for index, record in enumerate(records):
                if self._revokes != read_in:  # a rebalance meanwhile: the rest read again
                    await self.reader.unread(records[index:])
                    break
                if TopicPartition(record.topic, record.partition) not in self.consumer.assignment():
                    continue  # revoked mid-fetch: its new owner reads it from the commit
                self.offsets.taken(record.topic, record.partition, record.offset)
                await self._until_done(partial(self._admit, record, read_in))
            self.unreadable.pass_by(still_assigned=self._revokes == read_in)
            self._arrived.set()

    async def _admit(self, record: Record, read_in: int) -> None:
        headers = {name.lower(): value for name, value in record.headers}
        batch_id = text_of(headers.get(BATCH_ID_HEADER)) or text_of(record.key)
        api_key = bearer_token(headers.get(AUTHORIZATION_HEADER))
        caller = await self.callers.resolve(api_key)
        parsed = parse_line(record.value)
        known = caller.user_id if caller else await self.callers.revoked_owner(api_key)
        owner = known or "-"
        name = parsed.custom_id or f"@{record.partition}:{record.offset}"
        request_id = custom_line_request_id(owner, batch_id or "-", name)
        position = f"{record.partition}:{record.offset}"
        try:
            whole_id = check_batch_id(batch_id)
            if caller is None:
                raise Refused(
                    401,
                    "invalid or revoked API key",
                    "authentication_error",
                    code="invalid_api_key",
                )
            if parsed.line is None:
                raise parsed.problem or Refused(400, "invalid line", BAD)
            deadline_ms = batch_deadline_ms(headers.get(DEADLINE_HEADER))
            prompt = await prompt_for(self.checks, caller, whole_id, parsed.line, deadline_ms)
            if await self._seen_elsewhere(prompt.request_id, position):
                # Its row in batch_outputs is the first line's: the answer is not kept.
                message = f"custom_id {name!r} is used twice in batch {batch_id}"
                raise Refused(400, message, BAD, kept=False)
        except Refused as refused:
            if await self.marks.where(request_id) == position:  # answered before a crash
                self._done(record.partition, record.offset, "replayed")
                return
            if refused.kept and await self._seen_elsewhere(request_id, position):
                refused.kept = False  # a bad repeat: its refusal must not take the first's id
            owner_known = known if refused.kept else None
            if owner_known is not None and await self.marks.run_by_a_worker(request_id):
                # Forwarded before a crash lost its mark (its key revoked since, say):
                # its worker answers it (line_steps.LineSteps._taken_by_a_worker).
                await self._mark(request_id, position)
                self._done(record.partition, record.offset, "replayed")
                return
            if not refused.kept:  # a repeat: its answer's id is not its first line's
                request_id = custom_line_request_id(owner, batch_id or "-", f"{name}@{position}")
            await self._refuse(record, batch_id, owner_known, parsed.custom_id, request_id, refused)
            return
        if await self.marks.where(prompt.request_id) == position:
            self._done(record.partition, record.offset, "replayed")
            return
        waiting = Waiting(record.partition, record.offset, prompt, api_key)
        if await self._answered_unrun(waiting) or self._revokes != read_in:
            return  # answered, or revoked while it was checked: not queued
        self.queued.add(prompt.request_id, position, len(record.value or b""))
        # A tenant is what a quota counts (the user, in its key's tier): a tier over its
        # quota holds its own lines back, not those of the user's key of another tier.
        fair = self.settings.admission_fairness == "vtc"
        tenant = quota_account(owner, prompt.tier) if fair else "everyone"
        self.queues[prompt.model].push(tenant, waiting, time.monotonic())

    async def _seen_elsewhere(self, request_id: str, position: str) -> bool:
        """Another record of the batch already has this custom_id."""
        seen = self.queued.where(request_id) or await self.marks.where(request_id)
        return seen is not None and seen != position

    async def _refuse(
        self,
        record: Record,
        batch_id: str | None,
        owner: str | None,
        custom_id: str | None,
        request_id: str,
        refused: Refused,
    ) -> None:
        where = f"{record.partition}:{record.offset}"
        # %r: a batch id comes from any Kafka client; a newline in it forged log lines.
        log.info("refusing line %s of batch %.80r: %s", where, batch_id, refused)
        output = refused_output(
            custom_id,
            request_id,
            refused.status,
            refused.message,
            refused.kind,
            refused.param,
            refused.code,
        )
        await self.answers.send(owner, batch_id, output)
        # A repeat is not marked: its mark would be taken, read again after a restart,
        # as the first line's, which would then be refused as the repeat. Nor a line of
        # no one's (no known key): anyone who can write to the topic could fill Redis
        # with marks; replayed after a crash, it is answered again.
        if custom_id is not None and batch_id and refused.kept and owner is not None:
            await self._mark(request_id, where, first_only=True)
        # A defect's 500 counted apart, to alert on: the user's 4xx are theirs.
        self._done(
            record.partition, record.offset, "defect" if refused.status >= 500 else "refused"
        )

    async def _commit_often(self) -> None:
        while not self._stopping.is_set():
            await asyncio.sleep(COMMIT_EVERY_S)
            await self._commit()

    async def _commit(self) -> None:
        await commit_finished(self.consumer, self.offsets)

    async def _readiness(self) -> dict[str, bool]:
        return {
            "kafka": bool(self.consumer.assignment()),
            "accepting": not self._stopping.is_set(),
        }

    # ConsumerRebalanceListener: a partition that moves takes its waiting lines along
    # (the new owner reads them again from the committed offset).

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        self._revokes += 1
        await self._commit()
        gone = {tp.partition for tp in revoked}
        for queue in self.queues.values():
            for line in queue.remove(lambda w: w.partition in gone):
                # Its charge stays in Redis (the new owner's charge of the same id is
                # that one); what this member kept for its retry would stay for ever.
                self._charged.pop(line.prompt.request_id, None)
                self._too_large.pop(line.prompt.request_id, None)
        # By `queued`, not by what the queues held: a line being forwarded (a produce
        # retried) is out of its queue, and must not go on once its partition moved.
        self.queued.drop_partitions(gone)
        self.offsets.forget([(tp.topic, tp.partition) for tp in revoked])

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        every = self.consumer.partitions_for_topic(topics.BATCH_REQUESTS) or set()
        mine = [tp for tp in assigned if tp.topic == topics.BATCH_REQUESTS]
        self.band.share = len(mine) / len(every) if every else 1.0
        log.info(
            "assigned %s partitions %s",
            topics.BATCH_REQUESTS,
            sorted(tp.partition for tp in assigned),
        )
