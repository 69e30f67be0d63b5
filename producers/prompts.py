"""Publishing prompts to `prompts.<model>`, in the partition range of their band."""

from __future__ import annotations

import logging

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from schemas.codec import encode
from schemas.events import PromptRequest
from schemas.topics import BandLayout, prompts_topic
from tandoor.logs import bind_request_id
from tandoor.settings import Settings

log = logging.getLogger(__name__)


class PromptSubmitter:
    def __init__(self, settings: Settings, producer: AIOKafkaProducer) -> None:
        self._layout = BandLayout([(band.name, band.partitions) for band in settings.bands])
        self._producer = producer

    async def submit(self, prompt: PromptRequest) -> int:
        """Deliver the prompt durably; return the partition it went to."""
        bind_request_id(prompt.request_id)  # the rest of this request's lines carry it
        partition = self._layout.partition_for(prompt.band, prompt.conversation_id)
        topic = prompts_topic(prompt.model)
        if partition not in await self._producer.partitions_for(topic):
            # Bands widened without bootstrap: aiokafka asserts (a bare 500) instead.
            raise KafkaError(
                f"{topic} has no partition {partition} for band {prompt.band!r}: the bands "
                f"need {self._layout.total_partitions} partitions; run `tandoor bootstrap`"
            )
        await self._producer.send_and_wait(
            topic,
            encode(prompt),
            key=prompt.conversation_id.encode(),
            partition=partition,
        )
        log.info(
            "queued %s prompt for %s: band %s, partition %d, up to %d new tokens",
            prompt.kind,
            prompt.model,
            prompt.band,
            partition,
            prompt.sampling.max_tokens,
        )
        return partition
