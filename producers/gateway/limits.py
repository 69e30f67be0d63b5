"""Size limits on requests, each refused with the project's JSON error body:

- the head (request line and headers): uvicorn's httptools parser buffers it without a
  bound (measured: a 10 MB header and 200,000 headers were both accepted), so the
  gateway runs `BoundedHttpToolsProtocol`, which answers 431 and closes the connection
  once a head grows past `gateway_max_header_bytes`;
- the number of headers: past `gateway_max_headers`, 431;
- the body: past `gateway_max_body_bytes`, 413; from Content-Length before anything is
  read, or while a chunked body streams in (counted, never buffered here).

Each refusal counts in `REFUSED` by reason: most never reach a route, so the HTTP
metrics would not see them.
"""

from __future__ import annotations

import sys
from typing import Any

import httptools
import orjson
from prometheus_client import Counter
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from producers.gateway.timed_stream import ABORT
from schemas.errors import error_body

DISCONNECT: Message = {"type": "http.disconnect"}
REFUSED = Counter(
    "tandoor_gateway_refused_requests",
    "Requests refused for their size or shape before any route",
    ["reason"],
    registry=None,  # registered with the gateway's registry (producers/gateway/metrics.py)
)


def refusal(status: int, message: str, reason: str) -> JSONResponse:
    """The connection is closed after it: an unread body is not worth draining."""
    REFUSED.labels(reason).inc()
    body = error_body(message, "invalid_request_error")
    return JSONResponse(body, status_code=status, headers={"Connection": "close"})


class RequestLimits:
    """Pure ASGI middleware: header count and body size."""

    def __init__(
        self,
        app: ASGIApp,
        max_body_bytes: int,
        max_headers: int,
        larger_bodies: dict[str, int] | None = None,
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_headers = max_headers
        self.larger_bodies = larger_bodies or {}  # path -> its own limit (uploads)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self._limit(scope)
        refused = self._check_head(scope["headers"], limit)
        if refused is not None:
            await refused(scope, receive, send)
            return
        scope["headers"] = _without_leading_zeros(scope["headers"])
        guard = _BodyGuard(receive, send, limit)
        try:
            await self.app(scope, guard.receive, guard.send)
        except Exception:
            if not guard.refused:
                raise
            # The app failed on the cut-off body (ClientDisconnect): already answered.

    def _limit(self, scope: Scope) -> int:
        """A path's larger limit is for a multipart upload (its file goes to disk): a
        form of fields alone (urlencoded) is held whole in memory."""
        larger = self.larger_bodies.get(scope["path"])
        content_type = Headers(scope=scope).get("content-type", "").lower()
        if larger is not None and content_type.startswith("multipart/form-data"):
            return larger
        return self.max_body_bytes

    def _check_head(self, headers: list[tuple[bytes, bytes]], limit: int) -> JSONResponse | None:
        if len(headers) > self.max_headers:
            return refusal(431, f"more than {self.max_headers} request headers", "headers")
        for name, value in headers:
            if name != b"content-length":
                continue
            digits = value.strip()
            if not digits.isdigit():
                return refusal(400, "Content-Length is not a number", "content_length")
            # Measured before it is converted: past 4,300 digits (leading zeros, which
            # the parser lets through) int() raises, a 500 anyone could ask for.
            significant = digits.lstrip(b"0")
            if len(significant) > len(str(limit)) or int(significant or b"0") > limit:
                return refusal(413, f"request body larger than {limit} bytes", "body")
        return None


def _without_leading_zeros(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """Content-Length as the digits that count: what reads it after us (the metrics'
    int() among them) would fail on thousands of zeros."""
    return [
        (name, value.strip().lstrip(b"0") or b"0") if name == b"content-length" else (name, value)
        for name, value in headers
    ]


class _BodyGuard:
    """Counts the body as the app reads it. Past the limit it answers 413 itself, tells
    the app the client left, and drops whatever the app sends afterwards."""

    def __init__(self, receive: Receive, send: Send, limit: int) -> None:
        self._receive = receive
        self._send = send
        self._limit = limit
        self._read = 0
        self._started = False
        self.refused = False

    async def receive(self) -> Message:
        if self.refused:
            return DISCONNECT
        message = await self._receive()
        if message["type"] == "http.request":
            self._read += len(message.get("body", b""))
            if self._read > self._limit:
                await self._refuse()
                return DISCONNECT
        return message

    async def send(self, message: Message) -> None:
        if self.refused:
            return
        self._started = self._started or message["type"] == "http.response.start"
        await self._send(message)

    async def _refuse(self) -> None:
        self.refused = True
        if self._started:  # too late for a status: the response just stops
            return
        response = refusal(413, f"request body larger than {self._limit} bytes", "body")
        await response({"type": "http"}, self._receive, self._send)


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a bound on a request's head. A head that ends
    within the reads is measured; one still unfinished is counted read by read, so the
    parser never buffers more than the limit plus one read (asyncio reads 256 KiB at
    most). Set `max_head_bytes` on a subclass (see `bounded_protocol`)."""

    max_head_bytes = 64 * 1024

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_body = False
        self._progress = False  # a head or a message ended during this read
        self._oversized = False
        self._head_bytes = 0

    def data_received(self, data: bytes) -> None:
        self._progress = False
        super().data_received(data)
        if self.transport.is_closing():
            return
        if self._oversized:
            self._refuse_head()
        elif self._progress:
            self._head_bytes = 0  # what follows in this read is under one read: bounded
        elif not self._in_body:
            self._head_bytes += len(data)
            if self._head_bytes > self.max_head_bytes:
                self._refuse_head()

    def on_headers_complete(self) -> None:
        self._in_body = self._progress = True
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        self._oversized = size > self.max_head_bytes
        if not self._oversized:  # else the request never reaches the app
            super().on_headers_complete()
            extensions: dict[str, Any] = dict(self.scope.get("extensions") or {})
            extensions[ABORT] = self.transport.abort
            self.scope["extensions"] = extensions

    def on_body(self, body: bytes) -> None:
        if not self._oversized:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._in_body, self._progress = False, True
        if not self._oversized:
            super().on_message_complete()

    def _refuse_head(self) -> None:
        self.logger.warning("Request head over %d bytes: refused.", self.max_head_bytes)
        REFUSED.labels("head").inc()
        if self.cycle is not None and not self.cycle.response_complete:
            self.transport.close()  # mid-response: a status line now would corrupt it
            return
        message = f"request line and headers larger than {self.max_head_bytes} bytes"
        self._answer_and_close(b"431 Request Header Fields Too Large", message)

    def send_400_response(self, msg: str) -> None:
        """A request the parser refused (a malformed head, Content-Length with
        Transfer-Encoding): a JSON error naming the fault, as every other error is, not
        uvicorn's text/plain "Invalid HTTP request received.\""""
        fault = sys.exc_info()[1]  # called from the parser error's except clause
        if isinstance(fault, httptools.HttpParserError) and str(fault):
            msg = f"the request is not valid HTTP/1.1: {fault}"
        self._answer_and_close(b"400 Bad Request", msg)

    def _answer_and_close(self, status: bytes, message: str) -> None:
        body = orjson.dumps(error_body(message, "invalid_request_error"))
        head = (
            b"HTTP/1.1 %s\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n" % (status, len(body))
        )
        self.transport.write(head + body)
        self.transport.close()


def bounded_protocol(max_head_bytes: int) -> type[BoundedHttpToolsProtocol]:
    """The protocol class to hand uvicorn (`http=`) for this limit."""
    return type("BoundedHttpTools", (BoundedHttpToolsProtocol,), {"max_head_bytes": max_head_bytes})
