"""Hostile headers, parameters and bodies against the gateway over real Kafka, Cassandra
and Redis (its worker takes nothing, tests/idle_worker.py: prompts wait in Kafka, so a
reply stays running): a 400 naming the problem, never a 5xx, and nothing left behind."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest

from infra.idle_worker import idle_worker
from infra.process import free_port
from infra.roles import GatewayProcess, running
from producers.gateway.chat.sse import reply_tag
from producers.gateway.conversations.protocol import provisional_title
from schemas.events import MAX_STOP_CHARS
from tandoor.policies.api_keys import create_key
from tandoor.settings import Settings

pytestmark = pytest.mark.integration

FILE_LIMIT = 1024 * 1024  # the gateway's largest upload here (64 MiB by default)


@pytest.fixture(scope="module")
async def gateway(
    kafka: str, cassandra: Settings, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[httpx.AsyncClient]:
    """A gateway process (a client that leaves a stream early really closes it)."""
    env = {
        "TANDOOR_GATEWAY_GROUP": f"gw-hostile-{uuid.uuid4().hex[:8]}",
        "TANDOOR_GATEWAY_MAX_FILE_BYTES": str(FILE_LIMIT),
    }
    process = GatewayProcess(tmp_path_factory.mktemp("hostile"), free_port(), env)
    async with idle_worker(cassandra, cassandra.served_models[0]), running([process]):
        url = f"http://127.0.0.1:{process.port}"
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            yield http


@pytest.fixture
async def headers(cassandra: Settings) -> dict[str, str]:
    key, _ = await create_key(cassandra, f"hostile-{uuid.uuid4().hex[:8]}", "plus")
    return {"Authorization": f"Bearer {key}"}


async def conversation(http: httpx.AsyncClient, headers: dict[str, str]) -> str:
    created = await http.post("/v1/conversations", json={}, headers=headers)
    assert created.status_code == 201, created.text
    return str(created.json()["id"])


async def start_reply(http: httpx.AsyncClient, headers: dict[str, str], conv: str) -> str:
    """Post a message and read its start event; with no worker the reply stays running
    (closing the stream is not stop)."""
    path = f"/v1/conversations/{conv}/messages"
    async with http.stream("POST", path, json={"content": "Hello?"}, headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                assert '"type":"start"' in line.replace(" ", "")
                return line
    raise AssertionError("no start event")


def refused(response: httpx.Response, param: str) -> None:
    assert response.status_code == 400, (response.status_code, response.text)
    error = response.json()["error"]
    assert error["param"] == param and error["message"], error


@pytest.mark.parametrize("cursor", ["²~c_x", "99999999999999999999~c_x", "12~", "~c_x", "x"])
async def test_hostile_cursors_are_a_400(
    gateway: httpx.AsyncClient, headers: dict[str, str], cursor: str
) -> None:
    refused(
        await gateway.get("/v1/conversations", params={"cursor": cursor}, headers=headers), "cursor"
    )


def resume_headers(headers: dict[str, str], event_id: str) -> list[tuple[bytes, bytes]]:
    return [  # UTF-8 bytes, as a client may send them
        (b"Authorization", headers["Authorization"].encode()),
        (b"Last-Event-ID", event_id.encode()),
    ]


@pytest.mark.parametrize(
    "event_id",
    ["².1", "1.²", "99999999999999999999.1", "1", "a.b", "", "0a1b2c3g.1.1", "0a1b2c3d.1.1.1"],
)
@pytest.mark.parametrize("running", [True, False], ids=["running", "idle"])
async def test_hostile_last_event_ids_are_a_400(
    gateway: httpx.AsyncClient, headers: dict[str, str], event_id: str, running: bool
) -> None:
    """Idle: a 404 (no reply) came first, and a 429 with four resumes open."""
    conv = await conversation(gateway, headers)
    if running:
        await start_reply(gateway, headers, conv)
    raw = resume_headers(headers, event_id)
    resumed = await gateway.get(f"/v1/conversations/{conv}/stream", headers=raw)
    refused(resumed, "Last-Event-ID")


async def test_an_id_of_another_reply_is_a_404_not_a_place_in_this_one(
    gateway: httpx.AsyncClient, headers: dict[str, str]
) -> None:
    """Ids were only "<attempt>.<characters>": a client away while its reply ended and
    the next began got the next one cut at the first's length, joined to the first."""
    conv = await conversation(gateway, headers)
    running = orjson.loads((await start_reply(gateway, headers, conv)).removeprefix("data: "))
    path = f"/v1/conversations/{conv}/stream"
    other = await gateway.get(path, headers=resume_headers(headers, f"{reply_tag('r-1')}.1.250"))
    assert other.status_code == 404, other.text
    assert "Last-Event-ID" in other.json()["error"]["message"]
    own = f"{reply_tag(running['request_id'])}.1.0"
    async with gateway.stream("GET", path, headers=resume_headers(headers, own)) as resumed:
        assert resumed.status_code == 200, await resumed.aread()


async def test_a_second_post_while_a_reply_runs_is_a_409_and_stores_nothing(
    gateway: httpx.AsyncClient, headers: dict[str, str]
) -> None:
    conv = await conversation(gateway, headers)
    await start_reply(gateway, headers, conv)
    second = await gateway.post(
        f"/v1/conversations/{conv}/messages", json={"content": "Again?"}, headers=headers
    )
    assert second.status_code == 409 and second.json()["error"]["type"] == "conflict_error"
    messages = (await gateway.get(f"/v1/conversations/{conv}", headers=headers)).json()["messages"]
    assert [m["content"] for m in messages] == ["Hello?"]  # the refused one left no trace
    stop = await gateway.post(f"/v1/conversations/{conv}/stop", headers=headers)
    assert stop.status_code == 202  # the running reply is still the one Stop reaches


@pytest.mark.parametrize("tier", ["free", "plus"])
async def test_two_posts_at_once_run_one_and_refuse_the_other_uncharged(
    gateway: httpx.AsyncClient, cassandra: Settings, tier: str
) -> None:
    """Both passed the read-only check before either claimed the conversation: the
    loser was charged a request of the minute, or (one stream allowed) refused 429 by
    the winner's stream slot instead of the documented 409."""
    key, _ = await create_key(cassandra, f"race-{uuid.uuid4().hex[:8]}", tier)
    headers = {"Authorization": f"Bearer {key}"}
    conv = await conversation(gateway, headers)

    async def post(text: str) -> int:
        path = f"/v1/conversations/{conv}/messages"
        async with gateway.stream("POST", path, json={"content": text}, headers=headers) as r:
            return r.status_code

    assert sorted(await asyncio.gather(post("One?"), post("Two?"))) == [200, 409]
    usage = (await gateway.get("/v1/usage", headers=headers)).json()
    assert usage["limits"]["requests_per_minute"]["used"] == 1, usage["limits"]
    stop = await gateway.post(f"/v1/conversations/{conv}/stop", headers=headers)
    assert stop.status_code == 202


async def test_a_users_resumes_are_capped_and_others_still_post(
    gateway: httpx.AsyncClient, headers: dict[str, str], cassandra: Settings
) -> None:
    """A resume is charged no quota: one user resuming its running reply over and over
    held every stream slot of the replica, and everyone else's posts got 503s."""
    conv = await conversation(gateway, headers)
    await start_reply(gateway, headers, conv)
    path = f"/v1/conversations/{conv}/stream"
    async with contextlib.AsyncExitStack() as held:
        for _ in range(cassandra.gateway_resumes_per_user):
            opened = await held.enter_async_context(gateway.stream("GET", path, headers=headers))
            assert opened.status_code == 200
        refused = await gateway.get(path, headers=headers)
        assert refused.status_code == 429 and refused.headers["Retry-After"], refused.text
        key, _ = await create_key(cassandra, f"other-{uuid.uuid4().hex[:8]}", "plus")
        other = {"Authorization": f"Bearer {key}"}
        await start_reply(gateway, other, await conversation(gateway, other))
    async with gateway.stream("GET", path, headers=headers) as again:  # closed: given back
        assert again.status_code == 200
    await gateway.post(f"/v1/conversations/{conv}/stop", headers=headers)


async def test_a_new_chat_is_named_by_its_first_message_as_redacted(
    gateway: httpx.AsyncClient, headers: dict[str, str]
) -> None:
    """The page named a new chat with its first message as typed: an address or a card
    number stayed in the sidebar (redacted everywhere else), and the title job, which
    compares the title with the redacted message, never ran."""
    conv = await conversation(gateway, headers)  # untitled, as the page creates it
    path = f"/v1/conversations/{conv}/messages"
    too_long = await gateway.post(path, json={"content": "Sea. " * 3000}, headers=headers)
    assert too_long.status_code == 413, too_long.text  # refused: it names nothing
    untitled = (await gateway.get(f"/v1/conversations/{conv}", headers=headers)).json()
    assert untitled["title"] is None
    text = "Email bob@example.com the card 4111 1111 1111 1111 please"
    async with gateway.stream("POST", path, json={"content": text}, headers=headers) as r:
        assert r.status_code == 200
    stored = (await gateway.get(f"/v1/conversations/{conv}", headers=headers)).json()
    title, message = stored["title"], stored["messages"][0]["content"]
    assert title == provisional_title(message) and "@" not in title and "4111" not in title
    listed = (await gateway.get("/v1/conversations", headers=headers)).json()["data"]
    assert [c["title"] for c in listed if c["id"] == conv] == [title]
    await gateway.post(f"/v1/conversations/{conv}/stop", headers=headers)


COMPLETION = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}]}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 2}, "n"),
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"response_format": {"type": "json_object"}}, "response_format.type"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [""]}, "stop"),
        # Under the 1 MiB body limit, over Kafka's: a 503 "queue unreachable" that left
        # a failed message behind, and the SDK's retries two more.
        ({"stop": "x" * 1_048_400}, "stop"),
        ({"stop": ["a", "y" * (MAX_STOP_CHARS + 1)]}, "stop"),
        ({"top_p": 0}, "top_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"seed": 2**63}, "seed"),  # past a long (-1, "random" to some clients, is one)
        # Integers past 64 bits are read as floats (orjson): refused by the field's range.
        ({"seed": 10**30}, "seed"),
        ({"max_tokens": 10**30}, "max_tokens"),
        ({"tools": [{"type": "function"}]}, "tools"),  # unknown: refused, not ignored
        ({"stream_options": {"include_usage": True, "x": 1}}, "stream_options.x"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # not streamed
    ],
)
async def test_openai_parameters_are_honoured_or_refused_by_name(
    gateway: httpx.AsyncClient, headers: dict[str, str], extra: dict[str, Any], param: str
) -> None:
    response = await gateway.post("/v1/chat/completions", json=COMPLETION | extra, headers=headers)
    refused(response, param)
    listed = (await gateway.get("/v1/conversations", headers=headers)).json()["data"]
    assert listed == [], "a refused call leaves no conversation behind"


@pytest.mark.parametrize(("turns", "repeats"), [(8, 80), (1, 600)], ids=["turns", "one message"])
async def test_a_call_refused_after_parsing_leaves_no_conversation(
    gateway: httpx.AsyncClient, headers: dict[str, str], turns: int, repeats: int
) -> None:
    """Too long as a whole or in its last message alone: OpenAI's 400, on the OpenAI
    API as on the batch topic (one message alone was the chat page's 413 naming
    `content`, a field the request does not have)."""
    too_long = [{"role": "user", "content": "Tell me about the sea. " * repeats}] * turns
    response = await gateway.post(
        "/v1/chat/completions", json={"model": "smollm2", "messages": too_long}, headers=headers
    )
    refused(response, "messages")
    assert "context_length_exceeded" in response.json()["error"]["message"]
    listed = (await gateway.get("/v1/conversations", headers=headers)).json()["data"]
    assert listed == []


async def test_an_empty_last_message_is_answered_not_a_500(
    gateway: httpx.AsyncClient, headers: dict[str, str]
) -> None:
    """The first crash schemathesis found (a 500, fixed since): a completion whose last
    message has empty content."""
    body = {"model": "smollm2", "messages": [{"role": "user", "content": ""}], "stream": True}
    async with gateway.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        first = await anext(r.aiter_lines())
    assert first.startswith("data: ") and '"role":"assistant"' in first.replace(" ", "")


JSON_TYPE = {"content-type": "application/json"}
LONE_SURROGATE = "\\ud800"  # in JSON text: the escape of half a UTF-16 pair, no character


async def batch_input(http: httpx.AsyncClient, headers: dict[str, str], model: str) -> str:
    """An uploaded batch input file's id: a batch of it is stored, not refused."""
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body}
    files = {"file": ("in.jsonl", orjson.dumps(line) + b"\n")}
    uploaded = await http.post("/v1/files", files=files, data={"purpose": "batch"}, headers=headers)
    assert uploaded.status_code == 200, uploaded.text
    return str(uploaded.json()["id"])


@pytest.mark.parametrize("route", ["conversation title", "chat completion stop", "batch metadata"])
async def test_text_that_is_not_unicode_is_a_400_and_the_replica_serves_on(
    gateway: httpx.AsyncClient, headers: dict[str, str], cassandra: Settings, route: str
) -> None:
    """A lone surrogate reached the Cassandra driver (a false "Cassandra is unreachable"
    503 that cost the connection one of its stream ids each time) or a nested model (a
    bare 500)."""
    model = cassandra.served_models[0]
    bad = f'"a{LONE_SURROGATE}b"'
    path, body = {
        "conversation title": ("/v1/conversations", f'{{"title": {bad}}}'),
        "chat completion stop": (
            "/v1/chat/completions",
            f'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hi"}}], '
            f'"stop": [{bad}]}}',
        ),
        "batch metadata": ("/v1/batches", ""),
    }[route]
    if route == "batch metadata":
        file_id = await batch_input(gateway, headers, model)
        body = (
            f'{{"input_file_id": "{file_id}", "endpoint": "/v1/chat/completions", '
            f'"completion_window": "24h", "metadata": {{"k": {bad}}}}}'
        )
    answer = await gateway.post(path, content=body.encode(), headers=headers | JSON_TYPE)
    assert answer.status_code == 400, answer.text
    assert "not valid JSON" in answer.json()["error"]["message"], answer.json()
    assert (await gateway.get("/v1/conversations", headers=headers)).status_code == 200


@pytest.mark.parametrize("charset", ["utf-7", "raw_unicode_escape"])
async def test_a_file_name_that_is_not_unicode_is_a_400_and_nothing_is_stored(
    gateway: httpx.AsyncClient, headers: dict[str, str], charset: str
) -> None:
    """Multipart fields are decoded with the charset the client names: `+2AA-` in UTF-7
    is a lone surrogate. It reached the Cassandra driver after the file's chunks were
    written: a false "Cassandra is unreachable" 503, orphaned rows, a stream id lost."""
    name = b"+2AA-.jsonl" if charset == "utf-7" else b"\\ud800.jsonl"
    body = b"".join(
        [
            b'--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n',
            b'--B\r\nContent-Disposition: form-data; name="file"; filename="' + name + b'"\r\n',
            b"Content-Type: application/jsonl\r\n\r\n{}\n\r\n--B--\r\n",
        ]
    )
    content_type = {"content-type": f"multipart/form-data; boundary=B; charset={charset}"}
    answer = await gateway.post("/v1/files", content=body, headers=headers | content_type)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "file", answer.json()
    listed = await gateway.get("/v1/files", headers=headers)
    assert listed.status_code == 200 and listed.json()["data"] == []


@pytest.mark.parametrize(
    "metadata",
    [{"k" * 65: "v"}, {"k": "v" * 513}, {f"k{i}": "v" for i in range(17)}],
    ids=["long key", "long value", "17 pairs"],
)
async def test_batch_metadata_past_openais_limits_is_a_400(
    gateway: httpx.AsyncClient,
    headers: dict[str, str],
    cassandra: Settings,
    metadata: dict[str, str],
) -> None:
    body: dict[str, Any] = {
        "input_file_id": await batch_input(gateway, headers, cassandra.served_models[0]),
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
        "metadata": metadata,
    }
    answer = await gateway.post("/v1/batches", json=body, headers=headers)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"].startswith("metadata"), answer.json()


@pytest.mark.parametrize(
    "path", ["/v1/files/file-out-", "/v1/files/file-err-", "/v1/files/file-out-/content"]
)
async def test_a_batch_file_of_no_batch_is_a_404(
    gateway: httpx.AsyncClient, headers: dict[str, str], path: str
) -> None:
    """An empty batch id reached Cassandra, which refuses an empty key: a bare 500."""
    answer = await gateway.get(path, headers=headers)
    assert answer.status_code == 404, answer.text
    assert answer.json()["error"]["type"] == "not_found_error", answer.json()


async def test_a_file_of_the_largest_size_is_taken_and_one_byte_more_is_a_413(
    gateway: httpx.AsyncClient, headers: dict[str, str]
) -> None:
    """The limit was applied to the whole form, so a file of exactly the documented
    size was refused (its boundaries and part headers counted)."""
    line = b'{"custom_id": "a"}\n'
    largest = line + b" " * (FILE_LIMIT - len(line))
    taken = await gateway.post(
        "/v1/files",
        files={"file": ("f.jsonl", largest)},
        data={"purpose": "batch"},
        headers=headers,
    )
    assert taken.status_code == 200, taken.text
    assert taken.json()["bytes"] == FILE_LIMIT
    over = await gateway.post(
        "/v1/files",
        files={"file": ("f.jsonl", largest + b" ")},
        data={"purpose": "batch"},
        headers=headers,
    )
    assert over.status_code == 413, over.text
    assert over.json()["error"]["param"] == "file", over.json()
