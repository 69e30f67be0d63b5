"""A gateway that dies part-way through a write, against real Cassandra: at every
statement, before it is sent and after it is applied, what a user can see afterwards
is the whole record or nothing (a listed file that cannot be fetched, a conversation
without its message, are the failures)."""

from __future__ import annotations

import datetime as dt
import itertools
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from producers.gateway.batches.store import CHUNK_BYTES, FileStore, StoredFile
from producers.gateway.conversations.protocol import Conversation
from producers.gateway.conversations.service import (
    BATCHED_MESSAGE_BYTES,
    ConversationService,
    from_ms,
)
from producers.gateway.errors import ApiError

pytestmark = pytest.mark.integration

MODEL = "smollm2"
USER = "alice"
AT = dt.datetime(2026, 12, 1, 12, 0, 0, 123000)


class Died(RuntimeError):
    """The process wrote nothing more from here on."""


class DyingSession:
    """Passes statements to Cassandra until the process dies at statement `at`: before
    sending it, or once Cassandra has applied it (the answer lost). Nothing later is sent."""

    def __init__(self, session: Any, at: int, applied: bool) -> None:
        self._session = session
        self._at = at
        self._applied = applied
        self.sent = 0

    def execute_async(self, statement: Any, params: Any = None) -> Any:
        n, self.sent = self.sent, self.sent + 1
        if n > self._at or (n == self._at and not self._applied):
            raise Died(f"died before statement {n}")
        future = self._session.execute_async(statement, params)
        if n == self._at:
            future.result()  # applied on the server; the caller never hears of it
            raise Died(f"died after statement {n}")
        return future


async def every_crash(session: Any, write: Callable[[Any], Awaitable[None]]) -> list[str]:
    """Run `write` once whole (counting its statements), then once per crash point;
    a label for each interrupted run, in order."""
    whole = DyingSession(session, at=10**6, applied=True)
    await write(whole)
    runs = []
    for at, applied in itertools.product(range(whole.sent), (False, True)):
        with pytest.raises(Died):
            await write(DyingSession(session, at, applied))
        runs.append(f"died {'after' if applied else 'before'} statement {at} of {whole.sent}")
    return runs


async def test_an_upload_is_listed_and_fetchable_whole_or_not_at_all(session: Any) -> None:
    content = b"x" * (2 * CHUNK_BYTES + 10)  # three chunks
    files = FileStore(session)
    made: list[str] = []

    async def upload(through: Any) -> None:
        file_id = f"file-{uuid.uuid4().hex}"
        made.append(file_id)
        stored = StoredFile(file_id, USER, "batch", "in.jsonl", len(content), AT)
        await FileStore(through).create(stored, content)

    crashes = await every_crash(session, upload)
    listed = {f.file_id for f in await files.of_user(USER, 1000, "desc", None)}
    assert made[0] in listed  # the whole upload
    for file_id, crash in zip(made[1:], crashes, strict=True):
        stored = await files.get(file_id)
        assert (stored is not None) == (file_id in listed), crash
        if stored is not None:
            assert await files.content(file_id) == content, crash


@pytest.mark.parametrize(
    "question",
    ["what is my balance?", "é" * BATCHED_MESSAGE_BYTES],  # one batch; the message first
)
async def test_an_api_calls_conversation_appears_with_its_message_or_not_at_all(
    session: Any, question: str
) -> None:
    conversations = ConversationService(session, [MODEL])
    made: list[str] = []

    async def store_call(through: Any) -> None:
        conversation = Conversation(
            id=f"c_{uuid.uuid4().hex}", model=MODEL, title="t", created_at=AT, updated_at=AT
        )
        made.append(conversation.id)
        await ConversationService(through, [MODEL]).create_with_message(
            USER, conversation, f"m_{uuid.uuid4().hex}", question
        )

    crashes = await every_crash(session, store_call)
    page = await conversations.page(USER, 100, None)
    listed = {c.id for c in page.data}
    assert made[0] in listed
    for conversation_id, crash in zip(made[1:], crashes, strict=True):
        try:
            opened = await conversations.get(USER, conversation_id)
        except ApiError as exc:
            assert exc.status == 404, crash
            assert conversation_id not in listed, crash
            continue
        assert conversation_id in listed, crash
        assert [m.content for m in opened.messages] == [question], crash


@pytest.mark.parametrize("text", ["and in French?", "é" * BATCHED_MESSAGE_BYTES])
async def test_a_follow_up_message_never_hides_its_conversation(session: Any, text: str) -> None:
    """A sidebar row whose time its conversation does not have is passed over: moving to
    the top half done (the old row gone, the time not yet changed) hid the conversation."""
    conversations = ConversationService(session, [MODEL])
    made: list[tuple[str, dt.datetime]] = []

    async def follow_up(through: Any) -> None:
        opened = await conversations.create(USER, MODEL, "t")
        at_ms = int(opened.updated_at.timestamp() * 1000) + 60_000
        made.append((opened.id, from_ms(at_ms)))
        await ConversationService(through, [MODEL]).add_user_message(
            USER, opened, f"m_{uuid.uuid4().hex}", text, at_ms
        )

    crashes = await every_crash(session, follow_up)
    listed = {c.id: c.updated_at for c in (await conversations.page(USER, 1000, None)).data}
    assert listed[made[0][0]] == made[0][1]  # the whole write moved it to the top
    for (conversation_id, moved_at), crash in zip(made, ["whole", *crashes], strict=True):
        assert conversation_id in listed, crash
        stored = [m.content for m in (await conversations.get(USER, conversation_id)).messages]
        if listed[conversation_id] == moved_at:  # at the top: its message is there
            assert stored == [text], crash
