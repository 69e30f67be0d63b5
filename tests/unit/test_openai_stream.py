"""The OpenAI surface shows what the chat surface shows: replies redacted as they
stream and as a whole, exactly as they are stored."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import orjson

from producers.gateway.chat.service import Reply
from producers.gateway.openai_api.service import completion_body, completion_chunks
from tandoor.policies.moderation import DefaultModerator
from tests.unit.test_sse import feed, final, token

REPLY = "Write to anna.smith@example.org or call +1 415 555 0100 today."


def reply_of(text: str, size: int) -> Reply:
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    events = [token(p, seq) for seq, p in enumerate(pieces)] + [final(text)]
    watch = SimpleNamespace(events=lambda: feed(*events))
    return cast(Reply, SimpleNamespace(request_id="r", model="m", watch=watch))


async def streamed_text(reply: Reply) -> str:
    moderator = DefaultModerator()
    text = ""
    async for frame in completion_chunks(reply, False, moderator.output_filter()):
        data = frame.removeprefix("data: ").strip()
        if data != "[DONE]":
            chunk: dict[str, Any] = orjson.loads(data)
            text += "".join(c["delta"].get("content", "") for c in chunk["choices"])
    return text


async def test_streamed_and_whole_completions_are_redacted_as_stored() -> None:
    stored = DefaultModerator().check_output(REPLY)
    assert stored == "Write to [email] or call [phone] today."
    for size in (1, 4, 9):
        assert await streamed_text(reply_of(REPLY, size)) == stored, size
    whole = await completion_body(reply_of(REPLY, 5), DefaultModerator())
    assert whole["choices"][0]["message"]["content"] == stored
