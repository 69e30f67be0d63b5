"""A resumed stream begins as a posted one does, with a start event: a page whose post
was cut before its start arrived (a drain, a proxy) resumed a reply it could not stop
(Stop waits for the start) and showed its message without an id or an Edit button."""

from __future__ import annotations

import httpx
import orjson
import pytest

from producers.gateway.chat.sse import reply_tag
from tests.e2e.helpers import sse
from tests.integration.test_gateway_hostile import (  # noqa: F401 (fixtures)
    conversation,
    gateway,
    headers,
    resume_headers,
    start_reply,
)

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("from_start", [True, False])
async def test_a_resumed_stream_starts_with_the_posts_start_and_can_be_stopped(
    gateway: httpx.AsyncClient,  # noqa: F811
    headers: dict[str, str],  # noqa: F811
    from_start: bool,
) -> None:
    conv = await conversation(gateway, headers)
    posted = orjson.loads((await start_reply(gateway, headers, conv)).removeprefix("data: "))
    assert posted["user_message_id"]
    resuming = (
        headers if from_start else resume_headers(headers, f"{reply_tag(posted['request_id'])}.1.0")
    )
    path = f"/v1/conversations/{conv}/stream"
    async with gateway.stream("GET", path, headers=resuming) as resumed:
        assert resumed.status_code == 200, await resumed.aread()
        assert resumed.headers["X-Request-Id"] == posted["request_id"]
        events = aiter(sse(resumed))
        event_id, start = await anext(events)
        assert event_id is None, "Last-Event-ID stays the text's"
        named = ("type", "request_id", "conversation_id", "model", "user_message_id")
        assert {k: start[k] for k in named} == {k: posted[k] for k in named}
        stopped = await gateway.post(f"/v1/conversations/{conv}/stop", headers=headers)
        assert stopped.status_code == 202, stopped.text
        rest = [data async for _, data in events]
    assert rest[-1] == "[DONE]" and rest[-2]["type"] == "final"
    assert rest[-2]["finish_reason"] == "cancelled"
