"""Security against the whole stack, on a gateway replica of this module's own (its log
is read too): a key on every route, conversations isolated between many users, request
limits, fuzzed headers and bodies, and keys never logged nor stored in clear."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import secrets
import socket
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, seed
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from starlette.routing import Mount, Route

from infra.process import free_port
from infra.roles import GatewayProcess, running, with_models
from producers.gateway.app import create_app
from producers.gateway.web_page import WEB_DIR
from tandoor.clients import cassandra_session, cql, redis_client
from tandoor.policies.api_keys import KeyStore
from tandoor.policies.redis_keys import api_key_cache_key
from tests.e2e.helpers import sse, stored_reply
from tests.e2e.stack import Stack
from tests.seeds import SEED, seed_note

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


@dataclass
class Guarded:
    """This module's gateway replica, and every key the module used."""

    url: str
    gateway: GatewayProcess
    keys: KeyStore
    secrets: list[str] = field(default_factory=list)
    never_created: set[str] = field(default_factory=set)

    async def user(self, tier: str = "plus") -> dict[str, str]:
        key, _ = await self.keys.create(f"sec-{uuid.uuid4().hex[:8]}", tier)
        self.secrets.append(key)
        return {"Authorization": f"Bearer {key}"}

    async def revoked(self) -> str:
        key, _ = await self.keys.create(f"sec-revoked-{uuid.uuid4().hex[:8]}", "plus")
        self.secrets.append(key)
        assert await self.keys.resolve(key) is not None  # cached as valid first
        await self.keys.revoke(key)
        return key

    def unknown(self) -> str:
        key = "tdr_" + secrets.token_urlsafe(32)
        self.secrets.append(key)
        self.never_created.add(key)
        return key


@pytest.fixture(scope="module")
async def guarded(stack: Stack) -> AsyncIterator[Guarded]:
    env = {
        **with_models(stack.env, only=[stack.model]),
        "TANDOOR_FALLBACKS": "{}",
        "TANDOOR_GATEWAY_GROUP": f"gateway-sec-{uuid.uuid4().hex[:6]}",
    }
    gateway = GatewayProcess(stack.logs, free_port(), env)
    settings = stack.settings
    cache = redis_client(settings)
    try:
        with cassandra_session(settings, settings.keyspace) as session:
            async with running([gateway]):
                keys = KeyStore(session, cache, set(settings.tiers))
                yield Guarded(f"http://127.0.0.1:{gateway.port}", gateway, keys)
    finally:
        await cache.aclose()


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


async def owned_conversation(http: httpx.AsyncClient, headers: dict[str, str]) -> str:
    response = await http.post("/v1/conversations", json={"title": "mine"}, headers=headers)
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def concrete(path: str, conversation: str, message: str) -> list[str]:
    """The URLs to call for a route: each of the page's files for its mount."""
    if path == "/web/{path}":
        return [f"/web/{f.name}" for f in sorted(WEB_DIR.iterdir()) if f.is_file()]
    assert "{path}" not in path, f"a new mount at {path}: say here what it serves"
    ids = {"file_id": f"file-{message}", "batch_id": f"batch_{message}"}
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


# Request limits and fuzzing, over raw sockets: what a client library would refuse to send.


def exchange(port: int, data: bytes, half_close: bool = False) -> int | None:
    """Send one raw request; the answer's status, or None if the connection ended without
    one. `half_close` for a body shorter than declared: the server would wait for it."""
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        with contextlib.suppress(OSError):  # refused and reset while we were still sending
            sock.sendall(data)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        with contextlib.suppress(ConnectionError):  # the answer came, then a reset
            while b"\r\n" not in answer and (chunk := sock.recv(4096)):
                answer += chunk
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else None


LENGTHS = ["right", "short", "long", "junk", "none"]


def raw(
    method: str,
    path: str,
    headers: list[tuple[bytes, bytes]],
    body: bytes = b"",
    length: str = "right",
) -> bytes:
    """A raw request whose Content-Length is right, one short, ten long (the server
    waits for the rest), not a number, or missing (the body reads as a next request)."""
    declared = {
        "right": str(len(body)).encode(),
        "short": str(max(len(body) - 1, 0)).encode(),
        "long": str(len(body) + 10).encode(),
        "junk": b"12abc",
    }.get(length)
    lines = [b"%s %s HTTP/1.1" % (method.encode(), path.encode()), b"Host: gw"]
    lines += [b"%s: %s" % header for header in headers]
    lines += [b"Content-Length: " + declared] if declared is not None else []
    lines += [b"Connection: close", b"", body]
    return b"\r\n".join(lines)


async def test_oversized_requests_are_refused(guarded: Guarded) -> None:
    port, owner = guarded.gateway.port, await guarded.user()
    key = owner["Authorization"].encode()
    post = ("POST", "/v1/conversations")
    auth = [(b"Authorization", key), (b"Content-Type", b"application/json")]
    big = b'{"title": "' + b"t" * (1024 * 1024) + b'"}'
    cases = {
        413: raw(*post, auth, big),
        431: raw(*post, [*auth, (b"X-Big", b"a" * 70_000)], b"{}"),
    }
    many = [(b"X-H%d" % i, b"v") for i in range(120)]
    cases_many = raw(*post, [*auth, *many], b"{}")
    before = await refused_counts(guarded.gateway)
    for status, request in cases.items():
        assert await asyncio.to_thread(exchange, port, request) == status
    assert await asyncio.to_thread(exchange, port, cases_many) == 431
    assert await asyncio.to_thread(exchange, port, raw(*post, auth, b"{}")) == 201
    after = await refused_counts(guarded.gateway)
    counted = {r: n - before.get(r, 0) for r, n in after.items() if n > before.get(r, 0)}
    assert counted == {"body": 1, "head": 1, "headers": 1}, counted


async def refused_counts(gateway: GatewayProcess) -> dict[str, float]:
    """tandoor_gateway_refused_requests_total by reason, from the replica's /metrics."""
    async with httpx.AsyncClient() as client:
        page = await client.get(f"http://127.0.0.1:{gateway.ops_port()}/metrics")
    return {
        sample.labels["reason"]: sample.value
        for family in text_string_to_metric_families(page.text)
        if family.name == "tandoor_gateway_refused_requests"
        for sample in family.samples
        if sample.name.endswith("_total")
    }


# Hypothesis: random and malformed headers and bodies against the real gateway.


class Blob:
    """Bytes with a short repr: hypothesis prints the failing example's arguments."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __repr__(self) -> str:
        return f"Blob({len(self.data)} bytes: {self.data[:80]!r})"


KEYLIKE = st.sampled_from(["valid", "revoked", "unknown", "garbage"])
NON_CONTROL = st.characters(exclude_categories=["Cc", "Cs"])
ASCII = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40)
HEADER_VALUE = st.builds(
    Blob,
    st.one_of(
        ASCII.map(str.encode),
        st.binary(max_size=60).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")),
        st.binary(min_size=1, max_size=60).map(lambda b: bytes(c | 0x80 for c in b)),
        st.text(NON_CONTROL, max_size=30).map(str.encode),  # UTF-8: non-ASCII bytes
        st.integers(1, 80_000).map(lambda n: b"v" * n),  # past the head limit too
    ),
)
HEADER_NAME = st.one_of(
    st.sampled_from(
        [b"Authorization", b"Content-Type", b"Last-Event-ID", b"Accept", b"Origin", b"Cookie"]
    ),
    st.from_regex(rb"\A[A-Za-z][A-Za-z0-9-]{0,20}\Z"),
)
JSON_VALUE = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=50),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner),
    max_leaves=20,
)
BODY = st.builds(
    Blob,
    st.one_of(
        JSON_VALUE.map(lambda v: json.dumps(v).encode()),
        st.fixed_dictionaries(
            {"content": st.text(max_size=100) | st.integers() | st.none()},
            optional={"max_tokens": st.integers(-(10**30), 10**30), "temperature": JSON_VALUE},
        ).map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=200),  # not JSON, not UTF-8
        st.integers(1, 50_000).map(lambda n: b"[" * n + b"]" * n),  # deep nesting
        st.integers(300, 5000).map(lambda n: b'{"max_tokens": 1' + b"0" * n + b"}"),
        st.just(b'{"model": "x", "messages": [{"role": "user", "content": 1e999}]}'),
        st.integers(1024 * 1024 - 10, 1024 * 1024 + 10).map(lambda n: b'"' + b"s" * n + b'"'),
    ),
)


# Query strings: the parameters the API reads (cursor, limit) and others, with hostile
# values (non-ASCII digits, huge numbers, percent-encoded bytes, separators).
QUERY_VALUE = st.one_of(
    st.sampled_from(["", "10", "0", "-1", "²", "99999999999999999999", "12~", "%ff%fe", "~"]),
    st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=30),
    st.integers(-(10**25), 10**25).map(str),
)
QUERY = st.lists(
    st.tuples(st.sampled_from(["cursor", "limit", "model", "x"]), QUERY_VALUE), max_size=3
).map(
    lambda pairs: "?" + "&".join(f"{k}={v}".replace(" ", "%20") for k, v in pairs) if pairs else ""
)


@dataclass
class Target:
    port: int
    keys: dict[str, bytes]
    paths: list[str]
    answers: list[tuple[int | None, bytes]] = field(default_factory=list)


def fuzz(target: Target, examples: int) -> None:
    @hypothesis_settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(
        method=st.sampled_from(["GET", "POST", "PATCH", "DELETE", "PUT"]),
        path=st.sampled_from(target.paths),
        key=KEYLIKE,
        scheme=st.sampled_from([b"Bearer ", b"bearer ", b"Basic ", b""]),
        headers=st.lists(st.tuples(HEADER_NAME, HEADER_VALUE), max_size=130),
        body=BODY,
        length=st.sampled_from(LENGTHS),
        query=QUERY,
    )
    def one(
        method: str,
        path: str,
        key: str,
        scheme: bytes,
        headers: list[tuple[bytes, Blob]],
        body: Blob,
        length: str,
        query: str,
    ) -> None:
        sent = [(b"Authorization", scheme + target.keys[key])]
        sent += [(name, value.data) for name, value in headers]
        request = raw(method, path + query, sent, body.data, length)
        status = exchange(target.port, request, half_close=length == "long")
        target.answers.append((status, request[:200]))
        assert status is None or status < 500, request[:300]

    for case in explicit(target.paths[2]):
        one = example(**case)(one)
    try:
        seed(SEED)(one)()
    except BaseException as exc:
        exc.add_note(seed_note())
        raise


def explicit(path: str) -> list[dict[str, Any]]:
    """Run every time, with a valid key: an oversized body under every Content-Length,
    deep nesting and a number too long to convert."""
    json_type = [(b"Content-Type", Blob(b"application/json"))]
    bodies = [Blob(b'"' + b"s" * (2 << 20) + b'"')] * len(LENGTHS) + [
        Blob(b"[" * 100_000 + b"]" * 100_000),
        Blob(b'{"content": "hi", "max_tokens": 1' + b"0" * 5000 + b"}"),
    ]
    lengths = [*LENGTHS, "right", "right"]
    return [
        {
            "method": "POST",
            "path": path,
            "key": "valid",
            "scheme": b"Bearer ",
            "headers": json_type,
            "body": body,
            "length": length,
            "query": "",
        }
        for body, length in zip(bodies, lengths, strict=True)
    ]


async def test_fuzzed_headers_and_bodies_get_no_server_error(
    guarded: Guarded, http: httpx.AsyncClient
) -> None:
    owner = await guarded.user("fuzz")
    conversation = await owned_conversation(http, owner)
    keys = {
        "valid": owner["Authorization"].removeprefix("Bearer ").encode(),
        "revoked": (await guarded.revoked()).encode(),
        "unknown": guarded.unknown().encode(),
        "garbage": secrets.token_bytes(24).replace(b"\r", b"").replace(b"\n", b""),
    }
    base = f"/v1/conversations/{conversation}"
    paths = [
        "/v1/conversations",
        base,
        f"{base}/messages",
        f"{base}/stop",
        f"{base}/stream",
        f"{base}/regenerate",
        f"{base}/messages/{uuid.uuid4().hex}/edit",
        "/v1/chat/completions",
        "/v1/models",
        "/v1/conversations/%ff%fe",
        "/health",
    ]
    target = Target(guarded.gateway.port, keys, paths)
    await asyncio.to_thread(fuzz, target, 500)
    statuses = [status for status, _ in target.answers]
    assert len(statuses) >= 500  # every example ran (and the explicit ones)
    assert {400, 401, 413} <= set(statuses)  # the fuzzer reached past the parser and auth
    assert statuses.count(None) < len(statuses) / 2  # most requests got an answer
    assert guarded.gateway.proc is not None and guarded.gateway.proc.poll() is None
    assert (await http.get("/health")).status_code == 200
    assert "Traceback" not in guarded.gateway.log()


def sha256(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def found_in_logs(folder: Path, keys: list[str]) -> list[str]:
    """'<log file>: key|hash' for each key, or its SHA-256, found in a log under folder."""
    found = []
    for log in (p for p in folder.rglob("*") if p.is_file()):
        text = log.read_text(errors="replace")
        found += [f"{log.name}: key" for key in keys if key in text]
        found += [f"{log.name}: hash" for key in keys if sha256(key) in text]
    return found


async def test_keys_are_never_logged_and_stored_only_hashed(
    stack: Stack, guarded: Guarded, http: httpx.AsyncClient
) -> None:
    # Valid, revoked and unknown keys through the gateway (every key the module's other
    # tests used is checked too, whichever ran).
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
