"""Publishing prompts to `prompts.<model>`, in the partition range of their band."""

from __future__ import annotations

import logging

from aiokafka.errors import KafkaError, MessageSizeTooLargeError

from schemas.codec import encode
from schemas.events import PromptRequest
from schemas.topics import BandLayout, prompts_topic
from tandoor.logs import bind_request_id
from tandoor.renewing_producer import RenewingProducer
from tandoor.settings import Settings

log = logging.getLogger(__name__)


class PromptTooLarge(Exception):
    """Kafka refuses a record this large on every try: the caller's to shorten, not a
    queue to wait for (a long-context model's prompt can pass the 1 MiB record limit)."""

    def __init__(self, size: int) -> None:
        super().__init__(f"the prompt is {size} bytes encoded: more than the prompt queue takes")
        self.size = size


class PromptSubmitter:
    def __init__(self, settings: Settings, producer: RenewingProducer) -> None:
        self._layout = BandLayout([(band.name, band.partitions) for band in settings.bands])
        self._producer = producer

    async def submit(self, prompt: PromptRequest, affinity: str | None = None) -> int:
        """Deliver the prompt durably; return the partition it went to: the one of its
        `affinity` where given, else of its conversation. PromptTooLarge where Kafka
        will never take it."""
        bind_request_id(prompt.request_id)  # the rest of this request's lines carry it
        partition = self._layout.partition_for(prompt.band, affinity or prompt.conversation_id)
        topic = prompts_topic(prompt.model)
        if partition not in await self._producer.partitions_for(topic):
            # Bands widened without bootstrap: aiokafka asserts (a bare 500) instead.
            raise KafkaError(
                f"{topic} has no partition {partition} for band {prompt.band!r}: the bands "
                f"need {self._layout.total_partitions} partitions; run `tandoor bootstrap`"
            )
        value = encode(prompt)
        try:
            await self._producer.send_and_wait(
                topic, value, key=prompt.conversation_id.encode(), partition=partition
            )
        except MessageSizeTooLargeError as exc:
            raise PromptTooLarge(len(value)) from exc
        log.info(
            "queued %s prompt for %s: band %s, partition %d, up to %d new tokens",
            prompt.kind,
            prompt.model,
            prompt.band,
            partition,
            prompt.sampling.max_tokens,
        )
        return partition
