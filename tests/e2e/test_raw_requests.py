"""Request limits and fuzzed headers, bodies and query strings over raw sockets (what a
client library would refuse to send), against a gateway replica of this module's own:
oversized requests are refused and counted, and nothing makes it answer 5xx or die."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, seed
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from infra.roles import GatewayProcess
from tests.e2e.guarded import Guarded, owned_conversation
from tests.seeds import SEED, seed_note

pytestmark = pytest.mark.integration


@pytest.fixture
async def http(guarded: Guarded) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=guarded.url, timeout=120) as client:
        yield client


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


LENGTHS = ["right", "zeros", "short", "long", "junk", "none"]


def raw(
    method: str,
    path: str,
    headers: list[tuple[bytes, bytes]],
    body: bytes = b"",
    length: str = "right",
) -> bytes:
    """A raw request whose Content-Length is right, right after 5,000 zeros (past
    int()'s 4,300 digits), one short, ten long (the server waits for the rest), not a
    number, or missing (the body reads as a next request)."""
    declared = {
        "right": str(len(body)).encode(),
        "zeros": b"0" * 5000 + str(len(body)).encode(),
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
