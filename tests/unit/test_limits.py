"""Request limits and CORS, on a small FastAPI app with the gateway's middleware and
error handlers; the bounded HTTP protocol on a real uvicorn server on localhost."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import httpx
import orjson
import pytest
import uvicorn
from fastapi import FastAPI, Request
from starlette.types import Message

from infra.process import free_port
from producers.gateway.errors import install_error_handlers
from producers.gateway.limits import bounded_protocol
from producers.gateway.middleware import install_middleware
from tandoor.settings import Settings

LIMIT = 1000
SETTINGS = Settings(gateway_max_body_bytes=LIMIT, gateway_max_headers=20)
PAGE = "https://chat.example.com"


def echo_app(settings: Settings = SETTINGS) -> tuple[FastAPI, list[int]]:
    """An app whose POST /echo answers the body's length; `calls` records each call."""
    app = FastAPI()
    install_error_handlers(app)
    install_middleware(app, settings)
    calls: list[int] = []

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        body = await request.body()
        calls.append(len(body))
        return {"length": len(body)}

    return app, calls


def client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")


def assert_refused(response: httpx.Response, status: int, words: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert words in error["message"]
    assert error["type"] == "invalid_request_error"
    assert response.headers["connection"] == "close"


async def test_a_body_at_the_limit_is_served() -> None:
    app, calls = echo_app()
    async with client(app) as http:
        response = await http.post("/echo", content=b"x" * LIMIT)
    assert response.json() == {"length": LIMIT}
    assert calls == [LIMIT]


async def test_a_declared_length_over_the_limit_is_413_before_the_app_runs() -> None:
    app, calls = echo_app()
    async with client(app) as http:
        response = await http.post("/echo", content=b"x" * (LIMIT + 1))
    assert_refused(response, 413, f"larger than {LIMIT} bytes")
    assert calls == []


async def test_a_chunked_body_is_cut_off_once_past_the_limit() -> None:
    app, calls = echo_app()
    sent: list[int] = []

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: chunked
        for i in range(100):
            sent.append(i)
            yield b"y" * 300

    async with client(app) as http:
        response = await http.post("/echo", content=chunks())
    assert_refused(response, 413, f"larger than {LIMIT} bytes")
    assert calls == []
    assert len(sent) == 4  # 1200 bytes read, then no more: nothing buffered beyond


async def test_too_many_headers_is_431() -> None:
    app, calls = echo_app()
    headers = {f"x-h{i}": "v" for i in range(30)}
    async with client(app) as http:
        response = await http.post("/echo", content=b"{}", headers=headers)
    assert_refused(response, 431, "more than 20 request headers")
    assert calls == []


async def test_a_content_length_that_is_not_a_number_is_400() -> None:
    app, calls = echo_app()
    messages = await call_asgi(app, [(b"content-length", b"12abc")])
    start, body = messages[0], orjson.loads(messages[1]["body"])
    assert start["status"] == 400
    assert body["error"]["message"] == "Content-Length is not a number"
    assert calls == []


async def test_a_content_length_of_thousands_of_leading_zeros_is_measured_not_converted() -> None:
    """Past 4,300 digits int() raises: the gateway answered 500 and logged a traceback."""
    app, calls = echo_app()
    zeros = b"0" * 5000
    served = await call_asgi(app, [(b"content-length", zeros + b"2")])
    assert served[0]["status"] == 200 and calls == [2]
    refused = await call_asgi(app, [(b"content-length", zeros + b"9" * 5000)])
    assert refused[0]["status"] == 413
    assert b"larger than 1000 bytes" in refused[1]["body"]


async def call_asgi(app: FastAPI, headers: list[tuple[bytes, bytes]]) -> list[Message]:
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/echo",
        "raw_path": b"/echo",
        "query_string": b"",
        "headers": headers,
        "http_version": "1.1",
        "scheme": "http",
        "server": ("gw", 80),
        "client": ("127.0.0.1", 1),
        "root_path": "",
    }
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


async def preflight(http: httpx.AsyncClient, origin: str) -> httpx.Response:
    headers = {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    return await http.options("/echo", headers=headers)


async def test_no_origin_is_allowed_by_default() -> None:
    app, _ = echo_app()
    async with client(app) as http:
        pre = await preflight(http, PAGE)
        simple = await http.post("/echo", content=b"{}", headers={"Origin": PAGE})
    assert "access-control-allow-origin" not in pre.headers
    assert pre.status_code >= 400  # no preflight answer a browser would accept
    assert simple.status_code == 200  # served, but a browser hides it from the page
    assert "access-control-allow-origin" not in simple.headers


async def test_a_listed_origin_is_allowed_with_the_authorization_header() -> None:
    app, _ = echo_app(SETTINGS.model_copy(update={"cors_origins": [PAGE]}))
    async with client(app) as http:
        pre = await preflight(http, PAGE)
        simple = await http.post("/echo", content=b"{}", headers={"Origin": PAGE})
        other_pre = await preflight(http, "https://evil.example.com")
        other = await http.post("/echo", content=b"{}", headers={"Origin": "https://evil.test"})
        refused = await http.post("/echo", content=b"x" * 2000, headers={"Origin": PAGE})
    assert pre.status_code == 200
    assert pre.headers["access-control-allow-origin"] == PAGE
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    assert "access-control-allow-credentials" not in pre.headers
    assert simple.headers["access-control-allow-origin"] == PAGE
    assert other_pre.status_code == 400
    assert "access-control-allow-origin" not in other_pre.headers
    assert "access-control-allow-origin" not in other.headers
    assert refused.status_code == 413  # a refusal the listed page can read
    assert refused.headers["access-control-allow-origin"] == PAGE


# The bounded protocol, on a real server: raw requests over a socket.

HEAD_LIMIT = 4096


@asynccontextmanager
async def server() -> AsyncIterator[int]:
    app, _ = echo_app(SETTINGS.model_copy(update={"gateway_max_body_bytes": 1 << 20}))
    port = free_port()
    config = uvicorn.Config(
        app, port=port, http=bounded_protocol(HEAD_LIMIT), log_level="error", lifespan="off"
    )
    serving = uvicorn.Server(config)
    task = asyncio.create_task(serving.serve())
    for _ in range(1000):  # up in a few ms; bounded so a broken start fails the test
        if serving.started:
            break
        await asyncio.sleep(0.01)
    assert serving.started
    try:
        yield port
    finally:
        serving.should_exit = True
        await task


def request(body: bytes = b"{}", extra: bytes = b"", close: bool = True) -> bytes:
    """A raw POST /echo; the server closes the connection after answering it if `close`."""
    connection = b"Connection: close\r\n" if close else b""
    return b"POST /echo HTTP/1.1\r\nHost: gw\r\n%s%sContent-Length: %d\r\n\r\n%s" % (
        connection,
        extra,
        len(body),
        body,
    )


def pieces(data: bytes, size: int) -> Iterator[bytes]:
    return (data[i : i + size] for i in range(0, len(data), size))


async def exchange(port: int, writes: list[bytes]) -> bytes:
    """Send `writes` one by one (each its own read on the server), stopping once an
    answer came; everything the server answered."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    answer = bytearray()

    async def read_all() -> None:
        with contextlib.suppress(ConnectionResetError):
            while chunk := await reader.read(65536):
                answer.extend(chunk)

    reading = asyncio.create_task(read_all())
    with contextlib.suppress(ConnectionError):  # refused and closed while sending
        for data in writes:
            if b"HTTP/1.1 4" in answer:
                break
            writer.write(data)
            await writer.drain()
            await asyncio.sleep(0.002)
    await reading
    writer.close()
    return bytes(answer)


async def test_a_huge_header_is_431_and_the_connection_closed() -> None:
    huge = request(extra=b"X-Big: " + b"a" * 1_000_000 + b"\r\n")
    async with server() as port:
        answer = await exchange(port, list(pieces(huge, 2048)))
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 ")
    assert b"connection: close" in head
    message = orjson.loads(body)["error"]["message"]
    assert message == f"request line and headers larger than {HEAD_LIMIT} bytes"


async def test_a_head_over_the_limit_in_one_read_is_431_and_one_under_is_served() -> None:
    over = request(extra=b"X-Big: " + b"a" * HEAD_LIMIT + b"\r\n")
    under = request(extra=b"X-Big: " + b"a" * (HEAD_LIMIT - 200) + b"\r\n")
    async with server() as port:
        refused = await exchange(port, [over])
        served = await exchange(port, [under])
    assert refused.startswith(b"HTTP/1.1 431 ")
    assert served.startswith(b"HTTP/1.1 200 OK")


async def test_large_bodies_and_keep_alive_requests_are_not_mistaken_for_heads() -> None:
    # Many reads of body, the first sharing one with the head.
    big = request(b"z" * 500_000, close=False)
    async with server() as port:
        answer = await exchange(port, [big + request(close=False), request(b"q" * 10)])
    assert answer.count(b"HTTP/1.1 200 OK") == 3
    assert b'{"length":500000}' in answer
    assert b'{"length":10}' in answer


@pytest.mark.parametrize(
    ("extra", "fault"),
    [
        (b"Content-Length: 12abc\r\n", b"Content-Length"),
        (b"Content-Length: 2\r\nContent-Length: 3\r\n", b"Content-Length"),
        (b"Transfer-Encoding: chunked\r\nContent-Length: 2\r\n", b"Transfer-Encoding"),
    ],
    ids=["junk-length", "two-lengths", "length-and-chunked"],
)
async def test_a_head_the_parser_refuses_is_a_json_400_naming_the_fault(
    extra: bytes, fault: bytes
) -> None:
    """It was uvicorn's text/plain "Invalid HTTP request received.": a client reading
    every error as JSON failed on it, and learnt nothing of what was wrong."""
    raw = b"POST /echo HTTP/1.1\r\nHost: gw\r\n%s\r\n{}" % extra
    async with server() as port:
        answer = await exchange(port, [raw])
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), answer
    assert b"content-type: application/json" in head and b"connection: close" in head
    error = orjson.loads(body)["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("the request is not valid HTTP/1.1: ")
    assert fault.decode() in error["message"], error
