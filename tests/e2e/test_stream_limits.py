"""A replica's cap on open streams, and a reply no worker answers ending in an error
event instead of hanging: slow or stuck clients cannot exhaust a gateway."""

from __future__ import annotations

import uuid

import httpx
import pytest

from infra.process import free_port
from infra.roles import GatewayProcess, running
from tandoor.clients import redis_client
from tandoor.policies.redis_keys import cancel_key
from tests.e2e.helpers import auth, new_conversation, sse
from tests.e2e.stack import Stack

pytestmark = pytest.mark.integration


async def test_streams_beyond_the_cap_are_refused_until_one_ends(stack: Stack) -> None:
    env = {
        **stack.env,
        "TANDOOR_GATEWAY_GROUP": f"gateway-limits-{uuid.uuid4().hex[:6]}",
        "TANDOOR_GATEWAY_MAX_STREAMS": "1",
        "TANDOOR_QUEUE_TIMEOUT_S": "2",
        "TANDOOR_NO_WORKER_GRACE_S": "1",
    }
    gateway = GatewayProcess(stack.logs, free_port(), env)
    headers = await auth(stack, "plus")
    body = {"content": "Hello?", "max_tokens": 8}
    hi = [{"role": "user", "content": "Say hi."}]
    completion = {"model": stack.model, "messages": hi, "max_tokens": 4}
    async with (
        running([gateway]),
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.port}", timeout=60) as http,
    ):
        conversation = await new_conversation(http, headers, stack.big)  # its worker takes nothing
        path = f"/v1/conversations/{conversation}/messages"
        async with http.stream("POST", path, json=body, headers=headers) as open_stream:
            assert open_stream.status_code == 200
            events = sse(open_stream)
            started = (await anext(events))[1]
            assert started["type"] == "start"

            refused = await http.post(path, json=body, headers=headers)
            assert refused.status_code == 503 and refused.headers["Retry-After"]
            assert "streams open" in refused.json()["error"]["message"]
            # A completion that is not streamed holds its connection as long: it was
            # never counted (nor refused while the replica shut down).
            whole = await http.post("/v1/chat/completions", json=completion, headers=headers)
            assert whole.status_code == 503, whole.text
            assert "streams open" in whole.json()["error"]["message"]

            rest = [data async for _, data in events]
        assert rest[-2]["type"] == "error" and "no worker answered" in rest[-2]["error"]
        assert rest[-1] == "[DONE]"
        # Given up on, it is stopped: a worker that takes it late drops it, not runs it
        # uncharged (settled at zero, its real usage found it settled).
        redis = redis_client(stack.settings)
        try:
            assert await redis.exists(cancel_key(started["request_id"]))
        finally:
            await redis.aclose()

        whole = await http.post("/v1/chat/completions", json=completion, headers=headers)
        assert whole.status_code == 200, whole.text
        again = await http.post(
            f"/v1/conversations/{await new_conversation(http, headers)}/messages",
            json={"content": "Say hi.", "max_tokens": 4},
            headers=headers,
        )
        assert again.status_code == 200, "the slots were given back"
        assert again.text.rstrip().endswith("[DONE]")
