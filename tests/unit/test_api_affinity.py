"""Which partition an OpenAI API call's prompt goes to: each call is a conversation of
its own, so its conversation cannot keep a chat's turns together; the chat's opening
messages (or the caller's `prompt_cache_key`) do, on the worker whose prefix cache holds
their history."""

from __future__ import annotations

from typing import Any, cast

from producers.gateway.openai_api.service import opening_affinity
from producers.prompts import PromptSubmitter
from schemas.events import ChatMessage
from schemas.topics import BandLayout
from tandoor.settings import Settings
from tests.unit.test_transcript_records import prompt


def said(*turns: tuple[str, str]) -> list[ChatMessage]:
    return [ChatMessage(role=role, content=content) for role, content in turns]  # type: ignore[arg-type]


def test_every_turn_of_a_chat_has_its_opening_affinity() -> None:
    opening = [("system", "Be brief."), ("user", "Name a colour.")]
    first = opening_affinity(said(*opening))
    later = said(*opening, ("assistant", "Blue."), ("user", "Another?"))
    assert opening_affinity(later) == first
    assert opening_affinity(said(("system", "Be brief."), ("user", "Name a tree."))) != first
    assert opening_affinity(said(("user", "Name a colour."))) != first  # no system prompt


class Producer:
    def __init__(self) -> None:
        self.sent: list[int] = []

    async def partitions_for(self, topic: str) -> set[int]:
        return set(range(12))

    async def send_and_wait(self, topic: str, value: bytes, key: bytes, partition: int) -> None:
        self.sent.append(partition)


async def test_the_affinity_picks_the_partition_in_place_of_the_conversation() -> None:
    settings = Settings()
    producer = Producer()
    submitter = PromptSubmitter(settings, cast(Any, producer))
    layout = BandLayout([(band.name, band.partitions) for band in settings.bands])
    calls = [
        prompt().model_copy(update={"request_id": f"r_{i}", "conversation_id": f"c_{i}"})
        for i in range(8)
    ]
    for call in calls:
        await submitter.submit(call, "opening:same chat")
    band = calls[0].band
    assert set(producer.sent) == {layout.partition_for(band, "opening:same chat")}
    await submitter.submit(calls[0])  # a chat's message: by its conversation
    assert producer.sent[-1] == layout.partition_for(band, calls[0].conversation_id)
