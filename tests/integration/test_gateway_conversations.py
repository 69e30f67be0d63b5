"""The conversations API over HTTP against real Cassandra and Redis."""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import orjson
import pytest
from aiokafka.errors import KafkaConnectionError
from cassandra import OperationTimedOut

from infra.idle_worker import idle_worker
from infra.process import free_port
from infra.roles import GatewayProcess
from producers.gateway.app import create_app
from producers.gateway.chat.history import after_summary
from producers.gateway.chat.settled import MAX_MESSAGES
from producers.gateway.conversations import service as conversations_service
from producers.gateway.conversations.service import ConversationService
from producers.prompts import PromptTooLarge
from schemas.events import MessageKey, now_ms
from tandoor.clients import cassandra_session, redis_client
from tandoor.policies.api_keys import create_key
from tandoor.policies.redis_keys import inflight_key
from tandoor.settings import Settings
from tests.waiting import eventually

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
async def client(cassandra: Settings, redis_url: str) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(cassandra)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
            yield http


async def user_key(settings: Settings, user_id: str | None = None) -> dict[str, str]:
    key, _ = await create_key(settings, user_id or f"user-{uuid.uuid4().hex[:8]}", "plus")
    return {"Authorization": f"Bearer {key}"}


async def every_page(client: httpx.AsyncClient, auth: dict[str, str], limit: int) -> list[str]:
    """Conversation ids of the whole sidebar, following next_cursor page by page."""
    seen: list[str] = []
    params: dict[str, str | int] = {"limit": limit}
    while True:
        page = (await client.get("/v1/conversations", params=params, headers=auth)).json()
        seen += [c["id"] for c in page["data"]]
        if page["next_cursor"] is None:
            return seen
        params = {"limit": limit, "cursor": page["next_cursor"]}


async def test_every_route_but_health_needs_a_key(client: httpx.AsyncClient) -> None:
    assert (await client.get("/health")).status_code == 200
    for method, path in [
        ("GET", "/v1/conversations"),
        ("POST", "/v1/conversations"),
        ("GET", "/v1/conversations/c_x"),
        ("DELETE", "/v1/conversations/c_x"),
    ]:
        missing = await client.request(method, path)
        wrong = await client.request(method, path, headers={"Authorization": "Bearer tdr_nope"})
        for response in (missing, wrong):
            assert response.status_code == 401, (method, path)
            assert response.json()["error"]["type"] == "authentication_error"
            assert response.headers["www-authenticate"] == "Bearer"


async def test_create_list_get_rename_delete(client: httpx.AsyncClient, settings: Settings) -> None:
    auth = await user_key(settings)
    first = (await client.post("/v1/conversations", json={"title": "first"}, headers=auth)).json()
    second = await client.post(
        "/v1/conversations", json={"model": settings.served_models[0]}, headers=auth
    )
    assert second.status_code == 201 and first["model"] == settings.served_models[0]
    listed = (await client.get("/v1/conversations", headers=auth)).json()
    assert [c["id"] for c in listed["data"]] == [second.json()["id"], first["id"]]  # newest first

    renamed = await client.patch(
        f"/v1/conversations/{first['id']}", json={"title": "Paris trip"}, headers=auth
    )
    assert renamed.status_code == 200 and renamed.json()["title"] == "Paris trip"
    opened = (await client.get(f"/v1/conversations/{first['id']}", headers=auth)).json()
    assert opened["title"] == "Paris trip" and opened["messages"] == []
    listed = (await client.get("/v1/conversations", headers=auth)).json()
    assert {c["id"]: c["title"] for c in listed["data"]}[first["id"]] == "Paris trip"

    assert (
        await client.delete(f"/v1/conversations/{first['id']}", headers=auth)
    ).status_code == 204
    assert (await client.get(f"/v1/conversations/{first['id']}", headers=auth)).status_code == 404
    listed = (await client.get("/v1/conversations", headers=auth)).json()
    assert [c["id"] for c in listed["data"]] == [second.json()["id"]]


async def test_a_summary_finished_after_a_delete_does_not_bring_the_chat_back(
    client: httpx.AsyncClient, settings: Settings
) -> None:
    """A summary job runs for minutes in the batch band: its write into a conversation
    deleted meanwhile made the row again, unowned and out of reach, holding a summary
    of what the user deleted."""
    auth = await user_key(settings)
    made = (await client.post("/v1/conversations", json={"title": "x"}, headers=auth)).json()
    assert (await client.delete(f"/v1/conversations/{made['id']}", headers=auth)).status_code == 204
    with cassandra_session(settings, settings.keyspace) as session:
        service = ConversationService(session, settings.served_models)
        await service.set_summary(made["id"], "They told me a secret.", dt.datetime.now(dt.UTC))
        rows = session.execute(
            "SELECT summary FROM conversations WHERE conversation_id = %s", (made["id"],)
        )
        assert list(rows) == []


async def test_a_summary_stays_in_use_after_a_reply_it_never_held_was_regenerated(
    client: httpx.AsyncClient, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any replaced turn it covered made a summary stale: one made after an early reply
    was regenerated (that reply never in it) was never used, nor any later one. Stale
    only when a turn it covers is replaced after its job may have read it (here the
    job's time is none: after it was written)."""
    monkeypatch.setattr(conversations_service, "SUMMARY_WRITTEN_WITHIN_S", 0.0)
    auth = await user_key(settings, user := f"user-{uuid.uuid4().hex[:8]}")
    made = (await client.post("/v1/conversations", json={}, headers=auth)).json()
    with cassandra_session(settings, settings.keyspace) as session:
        service = ConversationService(session, settings.served_models)
        conversation = await service.owned(user, made["id"])
        start = now_ms()
        for n in range(3):
            await service.add_user_message(user, conversation, f"m_{n}", f"turn {n}", start + n)
        await service.mark_replaced(made["id"], [MessageKey(created_at_ms=start, message_id="m_0")])
        until = dt.datetime.fromtimestamp((start + 1) / 1000, dt.UTC)
        await service.set_summary(made["id"], "They said hello.", until)
        summary, turns = after_summary(await service.get(user, made["id"]))
        assert summary == "They said hello." and [m.id for m in turns] == ["m_2"]
        await service.mark_replaced(
            made["id"], [MessageKey(created_at_ms=start + 1, message_id="m_1")]
        )
        summary, turns = after_summary(await service.get(user, made["id"]))
        assert summary is None and [m.id for m in turns] == ["m_2"], "edited away since"


async def test_pages_run_newest_first_without_gaps(
    client: httpx.AsyncClient, settings: Settings
) -> None:
    auth = await user_key(settings)
    created = [
        (await client.post("/v1/conversations", json={}, headers=auth)).json()["id"]
        for _ in range(5)
    ]
    seen = await every_page(client, auth, limit=2)
    assert sorted(seen) == sorted(created) and len(seen) == 5  # no gaps, no repeats
    updated = [
        c["updated_at"]
        for c in (await client.get("/v1/conversations", params={"limit": 10}, headers=auth)).json()[
            "data"
        ]
    ]
    assert updated == sorted(updated, reverse=True)


async def test_conversations_sharing_a_millisecond_page_cleanly(
    client: httpx.AsyncClient, settings: Settings
) -> None:
    """Force ties: several sidebar rows with one updated_at, paged one at a time."""
    user = f"user-{uuid.uuid4().hex[:8]}"
    auth = await user_key(settings, user)
    created = [
        (await client.post("/v1/conversations", json={}, headers=auth)).json() for _ in range(4)
    ]
    with cassandra_session(settings, settings.keyspace) as session:
        tie = created[0]["updated_at"]
        for c in created:
            session.execute(
                "DELETE FROM conversations_by_user WHERE user_id = %s AND "
                "updated_at = %s AND conversation_id = %s",
                (user, _dt(c["updated_at"]), c["id"]),
            )
            session.execute(
                "INSERT INTO conversations_by_user (user_id, updated_at, "
                "conversation_id) VALUES (%s, %s, %s)",
                (user, _dt(tie), c["id"]),
            )
            session.execute(
                "UPDATE conversations SET updated_at = %s WHERE conversation_id = %s",
                (_dt(tie), c["id"]),
            )
    seen = await every_page(client, auth, limit=1)
    assert sorted(seen) == sorted(c["id"] for c in created) and len(seen) == 4


async def test_overlapping_moves_and_renames_leave_one_entry_each(
    client: httpx.AsyncClient, settings: Settings
) -> None:
    """Two messages and a rename of one conversation at once (a user typing while the
    title job runs): each starts from the same updated_at, so the sidebar gets a row per
    move. The list still shows each conversation once, and a delete leaves no row."""
    user = f"user-{uuid.uuid4().hex[:8]}"
    auth = await user_key(settings, user)
    created = [
        (await client.post("/v1/conversations", json={}, headers=auth)).json()["id"]
        for _ in range(3)
    ]
    now_ms = int(dt.datetime.now(dt.UTC).timestamp() * 1000)
    with cassandra_session(settings, settings.keyspace) as session:
        service = ConversationService(session, settings.served_models)
        for n, conversation_id in enumerate(created):
            before = await service.owned(user, conversation_id)
            await asyncio.gather(
                service.add_user_message(user, before, f"m_{n}a", "hi", now_ms + 10 * n),
                service.rename(user, conversation_id, f"title {n}"),
                service.add_user_message(user, before, f"m_{n}b", "hi", now_ms + 10 * n + 1),
            )
        sidebar_rows = list(
            session.execute(
                "SELECT conversation_id FROM conversations_by_user WHERE user_id = %s", (user,)
            )
        )
        assert len(sidebar_rows) > len(created)  # the overlap left rows behind

        listed = await every_page(client, auth, limit=2)
        assert listed == list(reversed(created))  # once each, newest message first
        titles = (await client.get("/v1/conversations", headers=auth)).json()["data"]
        assert [c["title"] for c in titles] == ["title 2", "title 1", "title 0"]

        for conversation_id in created:
            path = f"/v1/conversations/{conversation_id}"
            assert (await client.delete(path, headers=auth)).status_code == 204
        assert await every_page(client, auth, limit=2) == []
        left = session.execute(
            "SELECT conversation_id FROM conversations_by_user WHERE user_id = %s", (user,)
        )
        assert list(left) == []


async def test_users_never_see_each_others_conversations(
    client: httpx.AsyncClient, settings: Settings
) -> None:
    alice, bob = await user_key(settings), await user_key(settings)
    mine = (await client.post("/v1/conversations", json={"title": "secret"}, headers=alice)).json()
    path = f"/v1/conversations/{mine['id']}"
    assert (await client.get(path, headers=bob)).status_code == 404
    assert (await client.patch(path, json={"title": "x"}, headers=bob)).status_code == 404
    assert (await client.delete(path, headers=bob)).status_code == 404
    assert (await client.get("/v1/conversations", headers=bob)).json()["data"] == []
    still = (await client.get(path, headers=alice)).json()
    assert still["title"] == "secret"


async def test_bad_input_gets_a_4xx_that_names_the_problem(
    client: httpx.AsyncClient, settings: Settings
) -> None:
    auth = await user_key(settings)
    unknown = await client.post("/v1/conversations", json={"model": "gpt-9"}, headers=auth)
    assert unknown.status_code == 404  # as on the OpenAI API and a batch line
    assert "model 'gpt-9' does not exist" in unknown.json()["error"]["message"]
    assert unknown.json()["error"]["param"] == "model"
    extra = await client.post("/v1/conversations", json={"modle": "x"}, headers=auth)
    assert extra.status_code == 400 and "modle" in extra.json()["error"]["message"]
    long_title = await client.post("/v1/conversations", json={"title": "t" * 500}, headers=auth)
    assert long_title.status_code == 400 and long_title.json()["error"]["param"] == "title"
    # An empty title (as a rename refuses) left the chat "Untitled" for good: the first
    # message names only a chat with no title, and the title job then never ran.
    empty_title = await client.post("/v1/conversations", json={"title": ""}, headers=auth)
    assert empty_title.status_code == 400 and empty_title.json()["error"]["param"] == "title"
    bad_limit = await client.get("/v1/conversations", params={"limit": 0}, headers=auth)
    assert bad_limit.status_code == 400 and bad_limit.json()["error"]["param"] == "limit"
    not_json = await client.post("/v1/conversations", content=b"{", headers=auth)
    assert not_json.status_code == 400


def _dt(iso: str) -> dt.datetime:
    return dt.datetime.fromisoformat(iso.replace("Z", "+00:00"))


async def test_tandoor_gateway_serves_over_http(
    cassandra: Settings, redis_url: str, tmp_path: Path
) -> None:
    port = free_port()
    gateway = GatewayProcess(tmp_path, port, {})
    gateway.start()
    try:
        await gateway.wait_ready()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            assert (await http.get("/health")).json() == {"status": "ok"}
            assert (await http.get("/v1/conversations")).status_code == 401
            spec = (await http.get("/openapi.json")).json()
            assert "/v1/conversations/{conversation_id}" in spec["paths"]
    finally:
        # uvicorn drains, then re-raises SIGTERM: the conventional "terminated" status.
        assert gateway.terminate() in (0, -15)


async def test_resuming_a_reply_that_will_never_come_is_a_404(
    client: httpx.AsyncClient, settings: Settings
) -> None:
    """Its gateway died between claiming the conversation and queueing the prompt: the
    record stays for an hour, but nobody took the request by its start deadline.
    Resuming it hung, without a byte, for that hour (the page opening the chat too)."""
    auth = await user_key(settings)
    conversation_id = (await client.post("/v1/conversations", json={}, headers=auth)).json()["id"]
    record = {"request_id": f"r_{uuid.uuid4().hex}", "partition": 0, "offset": 0}
    redis = redis_client(settings)
    try:
        await redis.set(
            inflight_key(conversation_id),
            orjson.dumps({**record, "start_by_ms": now_ms() - 1}),
            ex=3600,
        )
        async with asyncio.timeout(60):
            resumed = await client.get(f"/v1/conversations/{conversation_id}/stream", headers=auth)
    finally:
        await redis.aclose()
    assert resumed.status_code == 404, resumed.text
    assert "no reply is being generated" in resumed.json()["error"]["message"]


async def test_a_full_conversation_takes_no_more_turns_and_says_so(
    client: httpx.AsyncClient, settings: Settings
) -> None:
    """Each turn read all its messages, replaced ones too: a conversation grown without
    end cost every turn, on the loop every stream of the replica shares, more and more."""
    auth = await user_key(settings)
    conversation = (await client.post("/v1/conversations", json={}, headers=auth)).json()["id"]
    start = dt.datetime(2026, 12, 1)
    with cassandra_session(settings, settings.keyspace) as session:
        insert = session.prepare(
            "INSERT INTO messages_by_conversation (conversation_id, created_at, message_id, "
            "role, content, status) VALUES (?, ?, ?, ?, 'earlier', 'complete')"
        )
        for n in range(MAX_MESSAGES):
            at = start + dt.timedelta(seconds=n)
            session.execute(insert, (conversation, at, f"m{n}", ("user", "assistant")[n % 2]))
    for path, body in (
        ("messages", {"content": "One more?"}),
        ("regenerate", {}),
        ("messages/m0/edit", {"content": "Again?"}),
    ):
        refused = await client.post(
            f"/v1/conversations/{conversation}/{path}", json=body, headers=auth
        )
        assert refused.status_code == 409, refused.text
        assert "start a new conversation" in refused.json()["error"]["message"]
    opened = await client.get(f"/v1/conversations/{conversation}", headers=auth)
    assert len(opened.json()["messages"]) == MAX_MESSAGES  # nothing added


@pytest.mark.parametrize(
    ("refusal", "status"), [(KafkaConnectionError(), 503), (PromptTooLarge(2_000_000), 413)]
)
async def test_kafka_then_cassandra_failing_says_the_message_may_be_kept(
    client: httpx.AsyncClient,
    monkeypatch: pytest.MonkeyPatch,
    settings: Settings,
    refusal: Exception,
    status: int,
) -> None:
    """Kafka refused the prompt (unreachable, or too large a record), then Cassandra the
    mark that shows its message failed: the 503 said "nothing was changed" (the 413 was
    a 503 so) of a message stored as sent, so the user sent it again, and both went into
    the next turn's context."""
    auth = await user_key(settings)
    conversation = (await client.post("/v1/conversations", json={}, headers=auth)).json()["id"]
    services = client._transport.app.state.services  # type: ignore[attr-defined]

    async def refused(*_: object) -> None:
        raise refusal

    async def timed_out(*_: object) -> None:
        raise OperationTimedOut("the mark timed out")

    monkeypatch.setattr(services.chat.deps.submitter, "submit", refused)
    monkeypatch.setattr(services.chat.deps.conversations, "mark_failed", timed_out)
    path = f"/v1/conversations/{conversation}/messages"
    model = settings.served_models[0]
    async with idle_worker(settings, model):  # the model is served, once the gateway sees it

        async def served() -> int:
            return getattr(services.load.load(model), "workers", 0)

        await eventually(served, what="the gateway to see a worker")
        posted = await client.post(path, json={"content": "Hello there"}, headers=auth)
    assert posted.status_code == status, posted.text
    said = posted.json()["error"]["message"]
    assert "nothing was" not in said and "regenerate" in said, said
    opened = (await client.get(f"/v1/conversations/{conversation}", headers=auth)).json()
    assert [(m["content"], m["status"]) for m in opened["messages"]] == [("Hello there", "sent")]
