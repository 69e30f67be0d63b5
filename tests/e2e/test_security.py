"""Security against the whole stack, on a gateway replica of this module's own
(tests/e2e/guarded.py; its log is read too): a key on every route, no cross-origin
calls, conversations isolated between many users, and keys never logged nor stored in
clear. Request limits and fuzzing over raw sockets: tests/e2e/test_raw_requests.py."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from starlette.routing import Mount, Route

from producers.gateway.app import create_app
from producers.gateway.web_page import WEB_DIR
from tandoor.clients import cassandra_session, cql, redis_client
from tandoor.policies.redis_keys import api_key_cache_key
from tests.e2e.guarded import Guarded, found_in_logs, owned_conversation, sha256
from tests.e2e.helpers import sse, stored_reply
from tests.e2e.stack import Stack

pytestmark = pytest.mark.integration

# What answers without a key: the chat page and its files, health, and the API's docs.
# A route outside this set that answers without a key fails the test.
PUBLIC = {
    ("GET", "/"),
    ("GET", "/web/{path}"),
    ("GET", "/health"),
    ("GET", "/ready"),
    ("GET", "/openapi.json"),
    ("GET", "/docs"),
    ("GET", "/docs/oauth2-redirect"),
    ("GET", "/redoc"),
}
ALWAYS_PUBLIC = {("GET", "/"), ("GET", "/web/{path}"), ("GET", "/health")}
USERS = 20
REPLYING = 3  # users whose conversations get a reply


@pytest.fixture
async def http(guarded: Guarded) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=guarded.url, timeout=120) as client:
        yield client


def router_operations(stack: Stack) -> set[tuple[str, str]]:
    """(method, path) of every route the gateway's code declares; a mount as `/{path}`."""
    operations = set()
    for route in create_app(stack.settings).routes:
        if isinstance(route, Mount):
            operations.add(("GET", f"{route.path}/{{path}}"))
        elif isinstance(route, Route):  # an APIRoute too
            operations |= {(m, route.path) for m in route.methods or () if m != "HEAD"}
    return operations


async def spec_operations(http: httpx.AsyncClient) -> set[tuple[str, str]]:
    spec = (await http.get("/openapi.json")).json()
    return {(m.upper(), path) for path, ops in spec["paths"].items() for m in ops}


def concrete(path: str, conversation: str, message: str) -> list[str]:
    """The URLs to call for a route: each of the page's files for its mount."""
    if path == "/web/{path}":
        return [f"/web/{f.name}" for f in sorted(WEB_DIR.iterdir()) if f.is_file()]
    assert "{path}" not in path, f"a new mount at {path}: say here what it serves"
    ids = {"file_id": f"file-{message}", "batch_id": f"batch_{message}", "model": "any"}
    return [path.format(conversation_id=conversation, message_id=message, **ids)]


def wrong_credentials(valid: str, revoked: str, unknown: str) -> list[dict[str, Any]]:
    """No key, malformed headers (even with a valid key in them), unknown and revoked keys."""
    return [
        {},
        {"Authorization": "Basic dXNlcjpwYXNz"},
        {"Authorization": "Bearer"},
        {"Authorization": f"Bearer\t{valid}"},
        {"Authorization": valid},
        {"Authorization": f"Token {valid}"},
        {"Authorization": f"Bearer {valid}x"},
        {"Authorization": f"Bearer {valid} {valid}"},
        {"Authorization": b"Bearer \xff\xfe" + valid.encode()},
        {"Authorization": f"Bearer {unknown}"},
        {"Authorization": f"Bearer {revoked}"},
    ]


def served(path: str, status: int) -> bool:
    """A public route's answer: a success, or /ready saying it is not ready."""
    return status < 400 or (path == "/ready" and status == 503)


async def test_every_route_but_the_public_ones_needs_a_valid_key(
    stack: Stack, guarded: Guarded, http: httpx.AsyncClient
) -> None:
    operations = router_operations(stack)
    assert await spec_operations(http) <= operations  # the live gateway runs this code
    assert operations >= ALWAYS_PUBLIC
    owner = await guarded.user()
    conversation = await owned_conversation(http, owner)
    valid = owner["Authorization"].removeprefix("Bearer ")
    wrong = wrong_credentials(valid, await guarded.revoked(), guarded.unknown())
    open_without_key = set()
    for method, path in sorted(operations):
        for url in concrete(path, conversation, uuid.uuid4().hex):
            for headers in wrong:
                response = await http.request(method, url, headers=headers, json={})
                if response.status_code != 401:
                    assert not headers, (method, url, headers, response.status_code)
                    assert served(path, response.status_code), (method, url, response.text)
                    open_without_key.add((method, path))
                    break
                assert response.headers["www-authenticate"] == "Bearer"
                assert response.json()["error"]["type"] == "authentication_error"
    assert open_without_key == PUBLIC & operations
    unchanged = await http.get(f"/v1/conversations/{conversation}", headers=owner)
    assert unchanged.json()["title"] == "mine" and unchanged.json()["messages"] == []


async def test_no_origin_may_call_the_api_by_default(
    guarded: Guarded, http: httpx.AsyncClient
) -> None:
    owner = await guarded.user()
    origin = {"Origin": "https://elsewhere.example.com"}
    preflight = await http.options(
        "/v1/models",
        headers={
            **origin,
            "Access-Control-Request-Method": "GET",
            "Access-Control-Request-Headers": "authorization",
        },
    )
    simple = await http.get("/v1/models", headers={**owner, **origin})
    assert simple.status_code == 200
    for response in (preflight, simple):
        assert not any(h.startswith("access-control-") for h in response.headers)


@dataclass
class Member:
    headers: dict[str, str]
    conversations: list[str]
    user_message: str | None = None  # in conversations[0], when it got a reply


async def members(guarded: Guarded, http: httpx.AsyncClient) -> list[Member]:
    """USERS users with two conversations each; the first REPLYING have a reply."""
    users = [Member(await guarded.user(), []) for _ in range(USERS)]
    for member in users:
        member.conversations = [await owned_conversation(http, member.headers) for _ in "ab"]
    await asyncio.gather(*(reply_in(http, m) for m in users[:REPLYING]))
    return users


async def reply_in(http: httpx.AsyncClient, member: Member) -> None:
    conversation = member.conversations[0]
    body = {"content": "Say hello.", "max_tokens": 4}
    path = f"/v1/conversations/{conversation}/messages"
    async with http.stream("POST", path, json=body, headers=member.headers) as response:
        assert response.status_code == 200
        _ = [data async for _, data in sse(response)]
    messages = await stored_reply(http, member.headers, conversation)
    member.user_message = messages[0]["id"]


def per_conversation(operations: set[tuple[str, str]]) -> list[tuple[str, str, Any]]:
    """Every route on one conversation, with a body it would accept from the owner."""
    bodies: dict[str, Any] = {
        "/messages": {"content": "not yours", "max_tokens": 2},
        "/edit": {"content": "not yours", "max_tokens": 2},
        "/regenerate": {"max_tokens": 2},
        "/v1/conversations/{conversation_id}": {"title": "not yours"},
    }
    found = []
    for method, path in sorted(operations):
        if "{conversation_id}" in path:
            body = next((b for end, b in bodies.items() if path.endswith(end)), None)
            found.append((method, path, body if method in ("POST", "PATCH") else None))
    return found


async def snapshot(http: httpx.AsyncClient, member: Member) -> list[Any]:
    """What the owner sees: their list, and each conversation's title and messages
    (not `updated_at`, which the persistence consumer may still touch after a reply)."""
    listed = await http.get("/v1/conversations?limit=100", headers=member.headers)
    seen: list[Any] = [sorted((c["id"], c["title"]) for c in listed.json()["data"])]
    for conversation in member.conversations:
        opened = await http.get(f"/v1/conversations/{conversation}", headers=member.headers)
        seen.append((opened.json()["title"], opened.json()["messages"]))
    return seen


async def test_each_user_sees_and_touches_only_their_own_conversations(
    stack: Stack, guarded: Guarded, http: httpx.AsyncClient
) -> None:
    users = await members(guarded, http)
    routes = per_conversation(router_operations(stack))
    assert len(routes) >= 8  # get, rename, delete, post, edit, regenerate, stop, stream
    before = [await snapshot(http, m) for m in users]
    for member, snap in zip(users, before, strict=True):
        assert {c for c, _ in snap[0]} == set(member.conversations)
    for i, victim in enumerate(users):
        thief = users[(i + 1) % USERS]
        message = victim.user_message or uuid.uuid4().hex
        for method, path, body in routes:
            url = path.format(conversation_id=victim.conversations[0], message_id=message)
            response = await http.request(method, url, json=body, headers=thief.headers)
            assert response.status_code == 404, (method, url, response.text)
            assert response.json()["error"]["type"] == "not_found_error"
    assert [await snapshot(http, m) for m in users] == before


async def test_another_user_cannot_stop_or_follow_a_running_reply(
    guarded: Guarded, http: httpx.AsyncClient
) -> None:
    owner, thief = await guarded.user(), await guarded.user()
    conversation = await owned_conversation(http, owner)
    body = {"content": "Count to fifty.", "max_tokens": 48, "ignore_eos": True}
    base = f"/v1/conversations/{conversation}"
    events = []
    async with http.stream("POST", f"{base}/messages", json=body, headers=owner) as response:
        async for _, data in sse(response):
            events.append(data)
            if len(events) == 1:  # started: the reply is in flight
                stop = await http.post(f"{base}/stop", headers=thief)
                follow = await http.get(f"{base}/stream", headers=thief)
                assert (stop.status_code, follow.status_code) == (404, 404)
    assert events[-2]["type"] == "final" and events[-2]["finish_reason"] == "length"


async def test_keys_are_never_logged_and_stored_only_hashed(
    stack: Stack, guarded: Guarded, http: httpx.AsyncClient
) -> None:
    # Valid, revoked and unknown keys through the gateway (every key a module on such a
    # replica used is checked again when it ends, the replica's whole log included).
    valid = await guarded.user()
    conversation = await owned_conversation(http, valid)
    assert (await http.get(f"/v1/conversations/{conversation}", headers=valid)).status_code == 200
    for key in (await guarded.revoked(), guarded.unknown()):
        refused = await http.get("/v1/conversations", headers={"Authorization": f"Bearer {key}"})
        assert refused.status_code == 401
    assert len(guarded.secrets) >= 3 and guarded.never_created
    assert guarded.gateway.log_file.is_relative_to(stack.logs)  # its log is read too
    assert await asyncio.to_thread(found_in_logs, stack.logs, guarded.secrets) == []
    await assert_stored_hashed(stack, guarded)


async def assert_stored_hashed(stack: Stack, guarded: Guarded) -> None:
    fresh = (await guarded.user())["Authorization"].removeprefix("Bearer ")
    assert await guarded.keys.resolve(fresh) is not None  # cached now, for a minute
    cache = redis_client(stack.settings)
    try:
        names = [name async for name in cache.scan_iter(match=api_key_cache_key("*"), count=1000)]
        cached = [v for v in await cache.mget(names) if v is not None] if names else []
    finally:
        await cache.aclose()
    assert api_key_cache_key(sha256(fresh)).encode() in names  # the right place
    with cassandra_session(stack.settings, stack.settings.keyspace) as session:
        for key in guarded.secrets:
            assert all(key.encode() not in blob for blob in [*names, *cached])
            rows = await cql(session, "SELECT * FROM api_keys WHERE key_hash = %s", (key,))
            assert rows == []  # no row under the key itself
            rows = await cql(session, "SELECT * FROM api_keys WHERE key_hash = %s", (sha256(key),))
            assert len(rows) == (0 if key in guarded.never_created else 1)
            for row in rows:
                assert row.key_hash == sha256(key)
                assert all(key not in str(value) for value in row)
