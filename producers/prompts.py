"""Publishing prompts to `prompts.<model>`, in the partition range of their band."""

from __future__ import annotations

from aiokafka import AIOKafkaProducer

from schemas.codec import encode
from schemas.events import PromptRequest
from schemas.topics import BandLayout, prompts_topic
from tandoor.settings import Settings


class PromptSubmitter:
    def __init__(self, settings: Settings, producer: AIOKafkaProducer) -> None:
        self._layout = BandLayout([(band.name, band.partitions) for band in settings.bands])
        self._producer = producer

    async def submit(self, prompt: PromptRequest) -> int:
        """Deliver the prompt durably; return the partition it went to."""
        partition = self._layout.partition_for(prompt.band, prompt.conversation_id)
        await self._producer.send_and_wait(
            prompts_topic(prompt.model),
            encode(prompt),
            key=prompt.conversation_id.encode(),
            partition=partition,
        )
        return partition
