"""An upload (the one route that takes 64 MiB) is refused for a missing or bad key
before its body is read: the key was checked only once the whole form was parsed, and
written to disk, so anyone without a key could make a replica take 64 MiB a request."""

from __future__ import annotations

import asyncio
import urllib.parse
from typing import Any

import httpx
import orjson
import pytest

from tandoor.settings import Settings
from tests.integration.test_gateway_hostile import (  # noqa: F401 (fixtures)
    FILE_LIMIT,
    batch_input,
    gateway,
    headers,
)

pytestmark = pytest.mark.integration

ANSWER_WAIT_S = 30  # the body never comes: an answer that waits for it never does


async def head_only(base: str, authorization: str | None) -> tuple[int, dict[str, Any]]:
    """POST /v1/files announcing a full-size body and sending none of it."""
    url = urllib.parse.urlsplit(base)
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    lines = [
        "POST /v1/files HTTP/1.1",
        f"Host: {url.netloc}",
        "Content-Type: multipart/form-data; boundary=b",
        f"Content-Length: {FILE_LIMIT}",
    ]
    if authorization is not None:
        lines.append(f"Authorization: {authorization}")
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
    await writer.drain()
    try:
        async with asyncio.timeout(ANSWER_WAIT_S):
            status = int((await reader.readline()).split()[1])
            head = (await reader.readuntil(b"\r\n\r\n")).decode().lower()
            length = int(head.split("content-length: ")[1].split("\r\n")[0])
            body = orjson.loads(await reader.readexactly(length))
    finally:
        writer.close()
    return status, body


@pytest.mark.parametrize("authorization", [None, "Bearer tdr_" + "A" * 43, "Basic abc"])
async def test_an_upload_without_a_valid_key_is_refused_before_its_body(
    gateway: httpx.AsyncClient,  # noqa: F811
    authorization: str | None,
) -> None:
    status, body = await head_only(str(gateway.base_url), authorization)
    assert status == 401 and body["error"]["code"] == "invalid_api_key", body


async def test_an_upload_with_a_valid_key_is_still_taken(
    gateway: httpx.AsyncClient,  # noqa: F811
    headers: dict[str, str],  # noqa: F811
    cassandra: Settings,
) -> None:
    assert await batch_input(gateway, headers, cassandra.served_models[0])
