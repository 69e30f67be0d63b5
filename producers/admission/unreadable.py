"""Records on `batch.requests` that aiokafka cannot parse (a header name that is not
UTF-8): the partition reader steps over them (tandoor/partition_reader.py). One cannot
be answered, its batch and caller being in the headers that cannot be read: the
dead-letter topic keeps where it was, the metric counts it, and the commit passes it,
but only once the records read with it (those before it) are taken, so that no commit
passes those before they are handled. Not passed, as a partition's last record it was
read and dead-lettered again after every restart."""

from __future__ import annotations

import logging

from aiokafka import TopicPartition
from aiokafka.errors import KafkaError

from producers.admission.metrics import AdmissionMetrics
from schemas import topics
from tandoor.offsets import OffsetTracker
from tandoor.renewing_producer import RenewingProducer

log = logging.getLogger(__name__)


class UnreadableRecords:
    def __init__(
        self, producer: RenewingProducer, offsets: OffsetTracker, metrics: AdmissionMetrics
    ) -> None:
        self._producer = producer
        self._offsets = offsets
        self._metrics = metrics
        self._dead_lettered: list[tuple[TopicPartition, int]] = []  # in the last read

    async def dead_letter(self, tp: TopicPartition, offset: int, reason: str) -> None:
        """The partition reader's callback, as it steps over the record."""
        self._metrics.lines.labels("unreadable").inc()
        headers = topics.dead_letter_headers(tp.topic, tp.partition, offset, reason)
        try:
            await self._producer.send_and_wait(topics.DEAD_LETTER, b"", headers=headers)
        except KafkaError as exc:  # the reader's log line is the trail then
            log.warning("dead-lettering %s/%s@%s failed: %s", *tp, offset, exc)
            return
        self._dead_lettered.append((tp, offset))

    def pass_by(self, still_assigned: bool) -> None:
        """The records of the last read are taken: the commit may pass the ones
        dead-lettered among them. After a revoke the next owner reads them again."""
        if still_assigned:
            for tp, offset in self._dead_lettered:
                self._offsets.taken(tp.topic, tp.partition, offset)
                self._offsets.finished(tp.topic, tp.partition, offset)
        self._dead_lettered.clear()
