"""`tandoor persist`: final events from `tokens` into Cassandra, committed only after
the write, so a crash at any point replays (idempotently) instead of losing.

While Cassandra cannot be reached, writes are retried for as long as it takes; while it
refuses writes whatever they hold (a grant revoked, a table missing mid-restore), for a
while (write_refusals.py). A final that fails for any other reason (Cassandra or the
driver refuses that one event) is tried POISON_TRIES times, then goes to the dead-letter
topic with the reason, and the consumer moves on: one bad event must not stop every
reply from being stored."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable

import orjson
from aiokafka import AIOKafkaConsumer
from aiokafka.errors import IllegalStateError, KafkaError, MessageSizeTooLargeError
from aiokafka.structs import ConsumerRecord
from cassandra.cluster import Cluster

from consumers.history import HistoryWriter
from consumers.metrics import PersistMetrics
from consumers.write_refusals import RefusalClock
from schemas import topics
from schemas.batch import final_output, too_large_output
from schemas.codec import SchemaError, decode, is_final
from schemas.events import FinalEvent
from tandoor.clients import cassandra_cluster, kafka_producer, send_dead_letter
from tandoor.ops import OpsServer
from tandoor.policies.moderation import DefaultModerator
from tandoor.settings import Settings

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 5.0
POISON_TRIES = 3
# Most of `tokens` is deltas, which persistence skips: committing after each fetch put a
# commit on the broker for every token at low load. A replay of skipped deltas costs
# nothing, so they are committed at most this often; a batch with finals at once.
DELTAS_COMMIT_S = 1.0
LAG_WAIT_S = 0.5  # the lag metric waits no longer for a partition's position
SEND_RETRY_S = 1.0  # dead letters and batch results: Kafka refused, try again after
Stored = tuple[ConsumerRecord[bytes, bytes], FinalEvent]


class Persister:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._consumer = AIOKafkaConsumer(
            topics.TOKENS,
            bootstrap_servers=settings.kafka_bootstrap,
            group_id=settings.persist_group,
            client_id="persist",
            enable_auto_commit=False,
            auto_offset_reset="earliest",  # a new group stores everything still retained
            fetch_max_wait_ms=settings.fetch_wait_ms,
        )
        self._producer = kafka_producer(settings, "persist")  # dead letters, batch results
        self._redact: Callable[[str], str] = str  # output moderation, set at start
        self._cluster: Cluster | None = None
        self._writer: HistoryWriter | None = None
        self._stopping = asyncio.Event()
        self._committed_at = 0.0  # monotonic
        self._uncommitted = False  # fetched since the last commit
        self._refusals = RefusalClock()
        self.metrics = PersistMetrics()
        self.ops = OpsServer("persist", self.metrics.registry, self._readiness)

    async def start(self) -> None:
        # Served first: liveness answers while it connects and joins (not ready yet).
        await self.ops.start(self.settings.host, self.settings.persist_metrics_port)
        self._cluster = cassandra_cluster(self.settings)
        session = await asyncio.to_thread(self._cluster.connect, self.settings.keyspace)
        moderator = DefaultModerator(self.settings.moderation_blocklist)
        self._redact = moderator.check_output
        self._writer = HistoryWriter(session, self._redact)
        await self._producer.start()
        await self._consumer.start()
        log.info("persist ready: %s -> keyspace %s", topics.TOKENS, self.settings.keyspace)

    def request_stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        while not self._stopping.is_set():
            batch = await self._consumer.getmany(timeout_ms=500, max_records=500)
            records = [record for chunk in batch.values() for record in chunk]
            finals, undecodable = _finals(records)
            for record, error in undecodable:  # kept where an operator can replay it
                if not await self._dead_letter(record, f"undecodable final: {error}"):
                    return  # stopping before Kafka took it: replayed by the next owner
            stored = await self._store(finals) if finals else []
            if stored is None:
                return  # stopping before the batch was stored: leave it uncommitted
            # Not a dead-lettered one's: its line has no stored answer for the Batches
            # API, and a replay of the dead letter would answer it again.
            if not await self._publish_batch_results([final for _, final in stored]):
                return  # stopping before the results were out: replayed by the next owner
            self._uncommitted |= bool(batch)
            if finals or (self._uncommitted and self._commit_due()):
                await self._commit()
                self.metrics.lag.set(await self._lag())
        await self._commit()  # a clean stop: the deltas since the last commit too

    def _commit_due(self) -> bool:
        return time.monotonic() - self._committed_at >= DELTAS_COMMIT_S

    async def _commit(self) -> None:
        """Commit what was fetched, all of it stored by now."""
        self._committed_at, self._uncommitted = time.monotonic(), False
        try:
            await self._consumer.commit()
        except KafkaError as exc:  # a rebalance: the new owner replays, idempotently
            log.warning("commit failed (%s); the next owner replays those replies", exc)

    async def _lag(self) -> int:
        """Records behind the newest, over the partitions fetched from so far. A metric:
        it never waits for a position (a partition just assigned has none until its
        committed offset is fetched, 40 s a try without a coordinator) and never raises
        (a partition revoked meanwhile: it stopped persist mid-rebalance)."""
        consumer, behind = self._consumer, 0
        for tp in consumer.assignment():
            try:
                highwater = consumer.highwater(tp)
                if highwater is not None:
                    async with asyncio.timeout(LAG_WAIT_S):
                        behind += max(0, highwater - await consumer.position(tp))
            except (IllegalStateError, AssertionError, TimeoutError):
                continue  # not ours any more, or not positioned yet: counted next time
        return behind

    async def _readiness(self) -> dict[str, bool]:
        hosts = self._cluster.metadata.all_hosts() if self._cluster is not None else []
        return {
            "cassandra": any(host.is_up for host in hosts),
            # A member beyond the tokens partition count gets none, and idles unready.
            "kafka": bool(self._consumer.assignment()),
            "accepting": not self._stopping.is_set(),
        }

    async def close(self) -> None:
        """Leave the group and disconnect; safe to call twice."""
        await self.ops.close()
        await self._consumer.stop()
        await self._producer.stop()
        if self._cluster is not None:
            await asyncio.to_thread(self._cluster.shutdown)
            self._cluster = None

    async def _store(self, finals: list[Stored]) -> list[Stored] | None:
        """Write until each is stored or dead-lettered; those stored, or None if told to
        stop first."""
        assert self._writer is not None
        pending, tries, delay = finals, Counter[tuple[int, int]](), 0.1
        stored: list[Stored] = []
        while pending and not self._stopping.is_set():
            started = time.perf_counter()
            results = await asyncio.gather(
                *(self._writer.store(final) for _, final in pending), return_exceptions=True
            )
            failed = [(item, r) for item, r in zip(pending, results, strict=True) if r is not None]
            written = [item for item, r in zip(pending, results, strict=True) if r is None]
            self._stored(written)
            stored += written
            self.metrics.write_seconds.observe(time.perf_counter() - started)
            pending = []
            for (record, final), error in failed:
                where = (record.partition, record.offset)
                tries[where] += self._refusals.counts(error, time.monotonic())
                if tries[where] >= POISON_TRIES:
                    reason = f"not stored after {POISON_TRIES} tries: {error!r}"
                    log.error("dead-lettering the final of %s: %s", final.request_id, reason)
                    if not await self._dead_letter(record, reason):
                        pending.append((record, final))  # stopping: left uncommitted
                else:
                    pending.append((record, final))
            if pending:
                self.metrics.failed_writes.inc()
                self.metrics.lag.set(await self._lag())  # held up: it grows meanwhile
                log.warning(
                    "storing %d replies failed (%r); retrying in %.1f s",
                    len(pending),
                    failed[0][1],
                    delay,
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), delay)
                delay = min(MAX_BACKOFF_S, delay * 2)
        return None if pending else stored

    async def _publish_batch_results(self, finals: list[FinalEvent]) -> bool:
        """Results of lines from `batch.requests`, once stored (again after a replay:
        each result's `id` names its request, so a reader can drop repeats). False if
        told to stop before Kafka took them."""
        lines = [f for f in finals if f.custom_id is not None and f.batch_id]
        results = [r for r in (_result(f, self._redact) for f in lines) if r is not None]

        async def send_all() -> None:
            sends = [await self._send_result(final, value) for final, value in results]
            await asyncio.gather(*sends)

        return not results or await self._until_sent(f"{len(results)} batch results", send_all)

    async def _send_result(self, final: FinalEvent, value: bytes) -> Awaitable[object]:
        """Kafka refuses a record past its size limit every time: the line is answered
        with an error in its place, not retried for good."""
        key = (final.batch_id or "").encode()
        try:
            sent: Awaitable[object] = await self._producer.send(
                topics.BATCH_RESULTS, value, key=key
            )
        except MessageSizeTooLargeError:
            log.error(
                "batch result of %s too large for Kafka (%d bytes)", final.request_id, len(value)
            )
            small = orjson.dumps(too_large_output(final.custom_id, final.request_id, len(value)))
            sent = await self._producer.send(topics.BATCH_RESULTS, small, key=key)
        return sent

    async def _until_sent(self, what: str, send: Callable[[], Awaitable[object]]) -> bool:
        """Retry `send` until Kafka takes it (a broker restarting, a leader moving);
        False if told to stop first, and the caller leaves its records uncommitted."""
        while True:
            try:
                await send()
                return True
            except KafkaError as exc:
                if self._stopping.is_set():
                    return False
                log.warning("sending %s failed (%r); retrying", what, exc)
                self.metrics.send_failures.inc()
                self.metrics.lag.set(await self._lag())  # held up: it grows meanwhile
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), SEND_RETRY_S)

    def _stored(self, stored: list[Stored]) -> None:
        self.metrics.stored.inc(len(stored))
        for _, final in stored:
            _log_stored(final)

    async def _dead_letter(self, record: ConsumerRecord[bytes, bytes], reason: str) -> bool:
        """False if told to stop before Kafka took it (a send that failed once stopped
        persistence: every restart met the same final and stopped again)."""
        sent = await self._until_sent(
            "a dead letter", lambda: send_dead_letter(self._producer, record, reason)
        )
        self.metrics.dead_lettered.inc(sent)
        return sent


def _log_stored(final: FinalEvent) -> None:
    log.info(
        "stored %s reply, attempt %d, %s: %d completion tokens",
        final.kind,
        final.attempt,
        final.finish_reason,
        final.usage.completion_tokens,
        extra={"request_id": final.request_id},
    )


def _result(final: FinalEvent, redact: Callable[[str], str]) -> tuple[FinalEvent, bytes] | None:
    """A batch line's result, serialized; None for a final no result can be made of (a
    forged one: token counts whose sum passes 64 bits), logged instead of stopping
    persistence on every restart."""
    try:
        return final, orjson.dumps(final_output(final, redact(final.text)))
    except (TypeError, ValueError) as exc:
        log.error("no batch result for %s: %r", final.request_id, exc)
        return None


def _finals(
    records: list[ConsumerRecord[bytes, bytes]],
) -> tuple[list[Stored], list[tuple[ConsumerRecord[bytes, bytes], SchemaError]]]:
    """The finals among `records`, and those that cannot be decoded (a newer schema
    version mid-upgrade, a foreign writer), which go to the dead-letter topic."""
    finals: list[Stored] = []
    undecodable: list[tuple[ConsumerRecord[bytes, bytes], SchemaError]] = []
    for record in records:
        if not is_final(record.value):
            continue  # a token event: the final carries the whole text
        try:
            finals.append((record, decode(FinalEvent, record.value)))
        except SchemaError as exc:
            log.error("undecodable final at %s/%s: %s", record.partition, record.offset, exc)
            undecodable.append((record, exc))
    return finals, undecodable
