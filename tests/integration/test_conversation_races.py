"""Writes racing the user in another tab. A conversation deleted while a message or a
rename is written to it: the write is refused with a 404 and leaves nothing behind (it
brought the row back without an owner, which every route, a second delete too, answered
404 for, and the message with it). A title the gateway or the model chose for the chat
as read untitled: a rename by the user meanwhile is kept."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from cassandra.cluster import Session

from producers.gateway.chat.settled import SettledHistory
from producers.gateway.conversations.protocol import Conversation
from producers.gateway.conversations.service import ConversationService
from producers.gateway.errors import ApiError
from producers.gateway.shedding import ModelRouter
from schemas.events import now_ms
from tandoor.clients import cassandra_session, cql
from tandoor.settings import Settings
from tests.integration.test_gateway_conversations import client, user_key
from tests.waiting import eventually

pytestmark = pytest.mark.integration

__all__ = ["client"]  # the gateway in-process, shared with the conversations tests


async def _left_behind(session: Session, user: str, conversation_id: str) -> dict[str, int]:
    """The rows of the conversation still stored, by table."""
    queries = {
        "messages": "SELECT message_id FROM messages_by_conversation WHERE conversation_id = %s",
        "conversations": "SELECT user_id FROM conversations WHERE conversation_id = %s",
    }
    found = {name: len(await cql(session, q, (conversation_id,))) for name, q in queries.items()}
    sidebar = await cql(
        session, "SELECT conversation_id FROM conversations_by_user WHERE user_id = %s", (user,)
    )
    found["sidebar"] = sum(r.conversation_id == conversation_id for r in sidebar)
    return found


@dataclass
class Chat:
    """A new chat of a new user, and the service that writes to it as a gateway does."""

    user: str
    headers: dict[str, str]
    id: str
    service: ConversationService
    session: Session

    @property
    def path(self) -> str:
        return f"/v1/conversations/{self.id}"


@contextlib.asynccontextmanager
async def new_chat(client: httpx.AsyncClient, settings: Settings) -> AsyncIterator[Chat]:
    user = f"user-{uuid.uuid4().hex[:8]}"
    headers = await user_key(settings, user)
    made = (await client.post("/v1/conversations", json={}, headers=headers)).json()
    with cassandra_session(settings, settings.keyspace) as session:
        service = ConversationService(session, settings.served_models)
        yield Chat(user, headers, made["id"], service, session)


async def _deleted_during(
    client: httpx.AsyncClient,
    settings: Settings,
    write: Callable[[ConversationService, str, Conversation], Awaitable[Any]],
) -> dict[str, int]:
    """Found, then deleted through the API, then written to as found: what is left."""
    async with new_chat(client, settings) as chat:
        found = await chat.service.owned(chat.user, chat.id)
        deleted = await client.delete(chat.path, headers=chat.headers)
        assert deleted.status_code == 204
        with pytest.raises(ApiError) as refused:
            await write(chat.service, chat.user, found)
        assert refused.value.status == 404
        again = await client.delete(chat.path, headers=chat.headers)
        assert again.status_code == 404
        return await _left_behind(chat.session, chat.user, chat.id)


@pytest.mark.parametrize("content", ["Hello there", "Sea. " * 1000], ids=["short", "long"])
async def test_a_message_sent_to_a_conversation_deleted_meanwhile_is_not_stored(
    client: httpx.AsyncClient, settings: Settings, content: str
) -> None:
    async def send(service: ConversationService, user: str, found: Conversation) -> None:
        at = now_ms()
        await service.add_user_message(user, found, "m_1", content, at, names_it=at)

    assert await _deleted_during(client, settings, send) == {
        "messages": 0,
        "conversations": 0,
        "sidebar": 0,
    }


async def test_a_rename_of_a_conversation_deleted_meanwhile_is_not_stored(
    client: httpx.AsyncClient, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def rename(service: ConversationService, user: str, found: Conversation) -> None:
        async def as_found(user_id: str, conversation_id: str) -> Conversation:
            return found  # read before the delete

        monkeypatch.setattr(service, "_owned", as_found)
        await service.rename(user, found.id, "Mine")

    assert await _deleted_during(client, settings, rename) == {
        "messages": 0,
        "conversations": 0,
        "sidebar": 0,
    }


async def _renamed_meanwhile(
    client: httpx.AsyncClient,
    settings: Settings,
    name_it: Callable[[ConversationService, str, Conversation, int], Awaitable[Any]],
) -> str | None:
    """Read untitled at `read_at`, renamed by the user through the API, then named by the
    gateway or the model as read: the title stored."""
    async with new_chat(client, settings) as chat:
        read_at = now_ms()
        found = await chat.service.owned(chat.user, chat.id)
        renamed = await client.patch(chat.path, json={"title": "Mine"}, headers=chat.headers)
        assert renamed.status_code == 200, renamed.text
        await name_it(chat.service, chat.user, found, read_at)
    title: str | None = (await client.get(chat.path, headers=chat.headers)).json()["title"]
    return title


async def test_a_rename_made_while_the_first_message_was_sent_keeps_its_title(
    client: httpx.AsyncClient, settings: Settings
) -> None:
    """The first message names an untitled chat: a rename that landed after the post read
    it untitled was replaced by the message's opening words."""

    async def first_message(
        service: ConversationService, user: str, found: Conversation, read_at: int
    ) -> None:
        named = found.model_copy(update={"title": "Hello there"})
        await service.add_user_message(user, named, "m_1", "Hello there", now_ms(), read_at)

    assert await _renamed_meanwhile(client, settings, first_message) == "Mine"


async def test_a_rename_made_while_the_model_titled_the_chat_keeps_its_title(
    client: httpx.AsyncClient, settings: Settings
) -> None:
    """The title job checks the chat was not renamed, then writes: a rename between the
    two was replaced by the model's title."""

    async def model_title(
        service: ConversationService, user: str, found: Conversation, read_at: int
    ) -> None:
        await service.rename(user, found.id, "Colours of the sea", as_of_ms=read_at)

    assert await _renamed_meanwhile(client, settings, model_title) == "Mine"


async def test_a_first_message_names_a_chat_made_on_a_gateway_whose_clock_is_ahead(
    client: httpx.AsyncClient, settings: Settings
) -> None:
    """The chat was made with a null title (a tombstone as of its creation), and its
    first message's title, written as of a moment no later on another gateway's clock,
    did not outlast it: untitled for good (the title job took that for a rename)."""
    async with new_chat(client, settings) as chat:
        found = await chat.service.owned(chat.user, chat.id)
        named = found.model_copy(update={"title": "Hello there"})
        behind = now_ms() - 5_000  # the other gateway's clock
        await chat.service.add_user_message(
            chat.user, named, "m_1", "Hello there", now_ms(), behind
        )
    opened = (await client.get(chat.path, headers=chat.headers)).json()
    assert opened["title"] == "Hello there"


async def test_a_regenerate_in_a_conversation_deleted_while_it_was_read_runs_no_reply(
    client: httpx.AsyncClient, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A regenerate writes no message, so no write found the delete another tab made
    while it read the history: its reply ran, was charged, and was stored in the
    deleted chat, with no owner to open or delete it again."""
    await eventually(  # it routes replies: its tokens partitions assigned
        lambda: client.get("/ready"), lambda r: r.status_code == 200, what="a ready gateway"
    )
    monkeypatch.setattr(ModelRouter, "busy", lambda *_: None)  # no worker: not refused
    async with new_chat(client, settings) as chat:
        found = await chat.service.owned(chat.user, chat.id)
        await chat.service.add_user_message(chat.user, found, "m_1", "Hello there", now_ms())
        read = SettledHistory.visible

        async def deleted_while_read(self: SettledHistory, *args: Any) -> Any:
            shown = await read(self, *args)
            await chat.service.delete(chat.user, chat.id)  # the other tab
            return shown

        monkeypatch.setattr(SettledHistory, "visible", deleted_while_read)
        path = f"{chat.path}/regenerate"
        async with client.stream("POST", path, json={}, headers=chat.headers) as regenerated:
            assert regenerated.status_code == 404
        monkeypatch.setattr(SettledHistory, "visible", read)
        again = await client.post(
            f"{chat.path}/messages", json={"content": "Hi"}, headers=chat.headers
        )
        assert again.status_code == 404  # nothing brought it back
        assert await _left_behind(chat.session, chat.user, chat.id) == {
            "messages": 0,
            "conversations": 0,
            "sidebar": 0,
        }
