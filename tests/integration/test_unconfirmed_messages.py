"""A user message Cassandra did not confirm: told so, and stored failed, never left
"sent" behind a 503 that said nothing was changed."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest
from cassandra import OperationTimedOut

from producers.gateway.conversations import service as service_module
from producers.gateway.conversations.service import ConversationService
from producers.gateway.errors import ApiError
from schemas.events import now_ms
from tandoor.clients import cassandra_session, cql, cql_together
from tandoor.settings import Settings
from tests.integration.test_gateway_conversations import client, user_key

pytestmark = pytest.mark.integration

__all__ = ["client"]  # the gateway in-process, shared with the conversations tests


@pytest.mark.parametrize(
    ("content", "applied"),
    [("Hello there", True), ("Hello there", False), ("Sea. " * 1000, False)],
    ids=["applied", "not-applied", "long"],
)
async def test_a_message_cassandra_did_not_confirm_is_shown_failed(
    client: httpx.AsyncClient,
    settings: Settings,
    monkeypatch: pytest.MonkeyPatch,
    content: str,
    applied: bool,
) -> None:
    """A timed-out batch may still be applied (Cassandra keeps a logged batch): the
    client was told "nothing was changed" while its message was stored "sent", taken
    into the next turn's context, and there twice after the client's retry. A message
    over 4 KiB is stored before the rows that show it, which may fail alone."""
    user = f"user-{uuid.uuid4().hex[:8]}"
    made = (
        await client.post("/v1/conversations", json={}, headers=await user_key(settings, user))
    ).json()
    with cassandra_session(settings, settings.keyspace) as session:
        service = ConversationService(session, settings.served_models)
        conversation = await service.owned(user, made["id"])
        real = cql_together

        async def timed_out(session: object, rows: list[Any]) -> None:
            monkeypatch.setattr(service_module, "cql_together", real)
            if applied:
                await real(session, rows)
            raise OperationTimedOut("the batch timed out")

        monkeypatch.setattr(service_module, "cql_together", timed_out)
        with pytest.raises(ApiError, match="saved as failed") as told:
            await service.add_user_message(user, conversation, "m_1", content, now_ms())
        assert told.value.status == 503 and "nothing was changed" not in told.value.message
        opened = await service.get(user, made["id"])
    shown = [(m.id, m.content, m.status) for m in opened.messages]
    assert shown == [("m_1", content, "failed")]


@pytest.mark.parametrize("applied", [True, False], ids=["applied", "not-applied"])
async def test_a_long_message_whose_own_insert_timed_out_is_shown_failed(
    client: httpx.AsyncClient, settings: Settings, monkeypatch: pytest.MonkeyPatch, applied: bool
) -> None:
    """A message over 4 KiB is inserted alone first: that insert timing out (and maybe
    applied) went up as "nothing was changed" while the message could be stored "sent"."""
    user = f"user-{uuid.uuid4().hex[:8]}"
    made = (
        await client.post("/v1/conversations", json={}, headers=await user_key(settings, user))
    ).json()
    content = "Sea. " * 1000
    with cassandra_session(settings, settings.keyspace) as session:
        service = ConversationService(session, settings.served_models)
        conversation = await service.owned(user, made["id"])
        real = cql

        async def timed_out(session: object, *statement: Any) -> Any:
            monkeypatch.setattr(service_module, "cql", real)
            if applied:
                await real(session, *statement)
            raise OperationTimedOut("the insert timed out")

        monkeypatch.setattr(service_module, "cql", timed_out)
        with pytest.raises(ApiError, match="saved as failed") as told:
            await service.add_user_message(user, conversation, "m_1", content, now_ms())
        assert told.value.status == 503
        opened = await service.get(user, made["id"])
    assert [(m.id, m.content, m.status) for m in opened.messages] == [("m_1", content, "failed")]
