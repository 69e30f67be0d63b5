"""A resumed stream (GET .../stream, with or without Last-Event-ID): it begins as a
posted one does, with a start event (a page whose post was cut before its start arrived
resumed a reply it could not stop, and showed its message without an id or an Edit
button), and shows the rest of the reply redacted as the whole reply is."""

from __future__ import annotations

import httpx
import orjson
import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer

from producers.gateway.chat.sse import reply_tag
from schemas import topics
from schemas.codec import encode
from tandoor.policies.redis_keys import inflight_key
from tests.e2e.helpers import sse
from tests.integration.test_gateway_hostile import (  # noqa: F401 (fixtures)
    conversation,
    gateway,
    headers,
    resume_headers,
    start_reply,
)
from tests.unit.test_fanout_handback import final, token

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


@pytest.mark.parametrize("sent", [0, 6, 9])
async def test_a_resumed_stream_redacts_the_rest_as_the_whole_reply_is(
    gateway: httpx.AsyncClient,  # noqa: F811
    headers: dict[str, str],  # noqa: F811
    producer: AIOKafkaProducer,
    redis: aioredis.Redis,
    sent: int,
) -> None:
    """An address split over three token events, resumed after `sent` characters shown:
    the rest shows it redacted, never a piece of it, and joins what was shown into the
    reply as the live stream and the stored text show it."""
    conv = await conversation(gateway, headers)
    posted = orjson.loads((await start_reply(gateway, headers, conv)).removeprefix("data: "))
    rid = posted["request_id"]
    record = await redis.get(inflight_key(conv))
    assert record is not None
    partition = orjson.loads(record)["partition"]
    deltas = ["Write to jo", "hn.smith@exa", "mple.com today."]
    ending = final(len(deltas)).model_copy(update={"request_id": rid, "text": "".join(deltas)})
    whole = "Write to [email] today."
    shown = whole[:sent]
    resuming = resume_headers(headers, f"{reply_tag(rid)}.1.{sent}") if sent else headers
    path = f"/v1/conversations/{conv}/stream"
    async with gateway.stream("GET", path, headers=resuming) as resumed:
        assert resumed.status_code == 200, await resumed.aread()
        for seq, delta in enumerate(deltas):  # the worker's, as the client waits
            event = token(seq, rid).model_copy(update={"delta": delta})
            await producer.send_and_wait(topics.TOKENS, encode(event), rid.encode(), partition)
        await producer.send_and_wait(topics.TOKENS, encode(ending), rid.encode(), partition)
        events = [data async for _, data in sse(resumed)]
    rest = "".join(e["delta"] for e in events if isinstance(e, dict) and e["type"] == "token")
    assert shown + rest == whole, rest
    assert events[-2]["type"] == "final" and events[-1] == "[DONE]"
