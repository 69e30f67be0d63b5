"""The upload key check, which runs before the app (and its error handlers): a store it
cannot reach is the same 503 as on every route, not a 500 "please report it"."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import orjson
from cassandra.cluster import NoHostAvailable
from starlette.types import Message

from producers.gateway.auth import KeyBeforeBody


class CassandraDown:
    async def resolve(self, key: str) -> None:
        raise NoHostAvailable("no host", {})


async def test_an_upload_while_cassandra_is_unreachable_is_a_503_naming_it() -> None:
    reached: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append("route")

    deps = SimpleNamespace(keys=CassandraDown())
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/files",
        "headers": [(b"authorization", b"Bearer tdr_" + b"A" * 43)],
        "app": SimpleNamespace(state=SimpleNamespace(services=deps)),
    }
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    async def receive() -> Message:
        raise AssertionError("the body was read")

    await KeyBeforeBody(app, ["/v1/files"])(scope, receive, send)
    assert reached == []
    assert sent[0]["status"] == 503 and (b"retry-after", b"5") in sent[0]["headers"]
    body = orjson.loads(sent[1]["body"])
    assert body["error"]["message"].startswith("Cassandra is unreachable"), body
