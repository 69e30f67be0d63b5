"""The official `openai` client, unchanged, against the gateway."""

from __future__ import annotations

import asyncio
import re
import uuid
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from schemas.events import ANSWERED
from tests.e2e.helpers import auth, sse, stored_reply
from tests.e2e.stack import Stack
from tests.e2e.test_operations import lines_about
from tests.waiting import eventually

pytestmark = pytest.mark.integration


def client(stack: Stack, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key=key, max_retries=0)


async def api_key(stack: Stack) -> str:
    return (await auth(stack))["Authorization"].removeprefix("Bearer ")


async def test_models_and_a_plain_completion(stack: Stack) -> None:
    async with client(stack, await api_key(stack)) as api:
        await plain_completion(api, stack)


async def plain_completion(api: openai.AsyncOpenAI, stack: Stack) -> None:
    models = [m.id async for m in api.models.list()]
    assert models == stack.settings.served_models
    assert (await api.models.retrieve(models[0])).id == models[0]  # it was a 404
    with pytest.raises(openai.NotFoundError) as unknown:
        await api.models.retrieve("no-such-model")
    assert unknown.value.code == "model_not_found"
    completion = await api.chat.completions.create(
        model=models[0],
        temperature=0,
        max_tokens=32,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    assert "Paris" in (completion.choices[0].message.content or "")
    # The id the gateway logs it under, as the SDK reads it for a support ticket.
    assert completion._request_id == completion.id.removeprefix("chatcmpl-")
    assert completion.choices[0].finish_reason in ANSWERED
    assert completion.usage is not None and completion.usage.completion_tokens > 0


async def test_usage_shows_the_prompt_tokens_the_prefix_cache_held(stack: Stack) -> None:
    # Unique to this test (the id), and several KV blocks long.
    system = f"Session {uuid.uuid4().hex}. " + "Answer in one short sentence. " * 60
    question: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Name a colour."},
    ]
    async with client(stack, await api_key(stack)) as api:
        usages = []
        for _ in range(2):
            completion = await api.chat.completions.create(
                model=stack.settings.served_models[0], messages=question, max_tokens=4
            )
            assert completion.usage is not None and completion.usage.prompt_tokens_details
            usages.append(completion.usage)
    first, second = usages
    assert first.prompt_tokens == second.prompt_tokens > 300
    assert first.prompt_tokens_details and first.prompt_tokens_details.cached_tokens == 0
    cached = second.prompt_tokens_details and second.prompt_tokens_details.cached_tokens
    assert cached and 0 < cached < second.prompt_tokens


async def test_streaming_with_usage_and_the_chat_is_stored(stack: Stack) -> None:
    key = await api_key(stack)
    async with client(stack, key) as api:
        text, usage, reasons = await streamed_completion(api, stack)
    assert "Paris" in text and reasons in (["stop"], ["length"])
    assert usage is not None and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=stack.url) as http:
        listed = (await http.get("/v1/conversations", headers=headers)).json()["data"]
        assert len(listed) == 1 and listed[0]["title"]  # the question, or the model's title
        messages = await stored_reply(http, headers, listed[0]["id"])
    assert [(m["role"], m["content"]) for m in messages] == [
        ("user", "What is the capital of France?"),
        ("assistant", text),
    ]


async def streamed_completion(api: openai.AsyncOpenAI, stack: Stack) -> tuple[str, Any, list[str]]:
    stream = await api.chat.completions.create(
        model=stack.settings.served_models[0],
        temperature=0,
        max_tokens=32,
        stream=True,
        stream_options={"include_usage": True},
        messages=[
            {"role": "system", "content": "Answer in one short sentence."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
    )
    assert stream.response.headers.get("X-Request-Id")
    text, usage, reasons = "", None, list[str]()
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    return text, usage, reasons


async def test_errors_come_back_as_openai_errors(stack: Stack) -> None:
    async with client(stack, await api_key(stack)) as api, client(stack, "tdr_wrong") as wrong:
        await openai_errors(api, wrong, stack)


async def openai_errors(api: openai.AsyncOpenAI, wrong: openai.AsyncOpenAI, stack: Stack) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist") as missing:
        await api.chat.completions.create(
            model="gpt-9", messages=[{"role": "user", "content": "hi"}]
        )
    assert missing.value.code == "model_not_found"  # what clients branch on, as OpenAI's
    with pytest.raises(openai.AuthenticationError) as unknown:
        await wrong.models.list()
    assert unknown.value.code == "invalid_api_key"
    with pytest.raises(openai.BadRequestError):
        await api.chat.completions.create(model=stack.settings.served_models[0], messages=[])
    # A context that does not fit is refused, not cut short behind the client's back.
    turns = [{"role": "user", "content": "Tell me about the sea. " * 40}] * 12
    with pytest.raises(openai.BadRequestError, match="context_length_exceeded"):
        await api.chat.completions.create(
            model=stack.settings.served_models[0],
            messages=[{"role": "system", "content": "Be brief."}, *turns],  # type: ignore[list-item]
        )


async def test_sampling_parameters_reach_the_model(stack: Stack) -> None:
    question: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Name a fruit and describe it."}
    ]
    model = stack.settings.served_models[0]
    async with client(stack, await api_key(stack)) as api:
        seeded = [
            await api.chat.completions.create(
                model=model,
                messages=question,
                temperature=1.0,
                seed=-7,  # a negative seed too (it was refused)
                max_tokens=8,
            )
            for _ in range(2)
        ]
        capital: list[ChatCompletionMessageParam] = [
            {"role": "user", "content": "What is the capital of France?"}
        ]
        stopped = await api.chat.completions.create(
            model=model,
            messages=capital,
            temperature=0,
            max_tokens=32,
            stop=["Paris"],
        )
        tuned = await api.chat.completions.create(
            model=model,
            messages=capital,
            max_tokens=8,
            top_p=0.5,
            presence_penalty=0.5,
            frequency_penalty=0.5,
            user="end-user-42",
        )
    texts = [c.choices[0].message.content for c in seeded]
    assert texts[0] and texts[0] == texts[1], texts  # the same seed, the same sample
    assert stopped.choices[0].finish_reason == "stop"
    assert "Paris" not in (stopped.choices[0].message.content or "")
    assert tuned.choices[0].message.content and tuned.usage is not None


async def test_store_false_keeps_no_conversation(stack: Stack) -> None:
    key = await api_key(stack)
    async with client(stack, key) as api:
        completion = await api.chat.completions.create(
            model=stack.settings.served_models[0],
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=8,
            store=False,
        )
    assert completion.choices[0].message.content
    async with httpx.AsyncClient(base_url=stack.url) as http:
        listed = await http.get("/v1/conversations", headers={"Authorization": f"Bearer {key}"})
    assert listed.json()["data"] == []


async def test_the_official_client_gets_a_400_naming_each_parameter_it_cannot_have(
    stack: Stack,
) -> None:
    question: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hi"}]
    refusals: list[tuple[dict[str, Any], str]] = [
        ({"n": 2}, "n"),
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ]
    async with client(stack, await api_key(stack)) as api:
        for extra, param in refusals:
            with pytest.raises(openai.BadRequestError) as refused:
                await api.chat.completions.create(
                    model=stack.settings.served_models[0], messages=question, **extra
                )
            assert param in str(refused.value.body), (param, refused.value.body)


async def test_an_unstreamed_completion_its_client_leaves_is_stopped(stack: Stack) -> None:
    """A call given up on (an SDK's timeout, a closed connection) ran on to max_tokens,
    charged, holding a stream slot; the SDK's retry then ran a second one beside it."""
    headers = await auth(stack)
    body = {
        "model": stack.settings.served_models[0],
        "max_tokens": 400,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
    }
    async with httpx.AsyncClient(base_url=stack.url, timeout=None) as http:
        call = asyncio.create_task(http.post("/v1/chat/completions", json=body, headers=headers))

        async def conversations() -> list[Any]:
            return list((await http.get("/v1/conversations", headers=headers)).json()["data"])

        (conversation,) = await eventually(conversations, what="the call's conversation")
        path = f"/v1/conversations/{conversation['id']}/stream"
        async with http.stream("GET", path, headers=headers) as followed:
            async for _, data in sse(followed):
                if isinstance(data, dict) and data.get("type") == "token":
                    break  # the reply is being written: now its client gives up
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        (reply,) = [
            m
            for m in await stored_reply(http, headers, conversation["id"])
            if m["role"] == "assistant"
        ]
    assert reply["status"] == "stopped", reply


async def test_a_stream_its_client_leaves_is_stopped_and_frees_the_slot(stack: Stack) -> None:
    """The OpenAI API cannot resume a stream: one whose client went (a break, a timeout)
    ran on to max_tokens, charged, holding a free user's only stream slot (every call
    meanwhile a 429). It is stopped as by the stop button."""
    headers = await auth(stack, "free")
    key = headers["Authorization"].removeprefix("Bearer ")
    model = stack.settings.served_models[0]
    async with client(stack, key) as api:
        story = await api.chat.completions.create(
            model=model,
            max_tokens=400,
            stream=True,
            extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": "Write a long story about a dragon."}],
        )
        async for chunk in story:
            if any(choice.delta.content for choice in chunk.choices):
                break
        await story.close()
        async with httpx.AsyncClient(base_url=stack.url) as http:

            async def streams_held() -> int:
                usage = (await http.get("/v1/usage", headers=headers)).json()
                return int(usage["limits"]["concurrent_streams"]["used"])

            # The tier has two: the slot is freed, not merely one of them left.
            await eventually(streams_held, lambda held: held == 0, what="the stream slot freed")
        answered = await api.chat.completions.create(
            model=model, max_tokens=4, messages=[{"role": "user", "content": "Hi"}]
        )
    assert answered.choices[0].finish_reason in ("stop", "length")
    async with httpx.AsyncClient(base_url=stack.url) as http:
        listed = (await http.get("/v1/conversations", headers=headers)).json()["data"]
        (first,) = [c for c in listed if c["title"] == "Write a long story about a dragon."]
        (reply,) = [
            m for m in await stored_reply(http, headers, first["id"]) if m["role"] == "assistant"
        ]
    assert reply["status"] == "stopped", reply


@pytest.mark.parametrize("streamed", [False, True], ids=["unstreamed", "streamed"])
async def test_a_completion_stopped_from_its_chat_is_an_error_not_an_answer(
    stack: Stack, streamed: bool
) -> None:
    """Stopped from the chat page (the sidebar lists stored API calls), the call got
    finish_reason "stop": a cut-off answer its client could not tell from a whole one."""
    headers = await auth(stack)
    key = headers["Authorization"].removeprefix("Bearer ")
    # The SDK's own retries, as a caller has them: a 409 is retried unless marked not to.
    retrying = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key=key)
    async with retrying as api, httpx.AsyncClient(base_url=stack.url) as http:

        async def stop_once_writing() -> None:
            async def conversations() -> list[Any]:
                return list((await http.get("/v1/conversations", headers=headers)).json()["data"])

            (conversation,) = await eventually(conversations, what="the call's conversation")
            path = f"/v1/conversations/{conversation['id']}"
            async with http.stream("GET", f"{path}/stream", headers=headers) as followed:
                async for _, data in sse(followed):
                    if isinstance(data, dict) and data.get("type") == "token":
                        break
            assert (await http.post(f"{path}/stop", headers=headers)).status_code == 202

        call = api.chat.completions.create(
            model=stack.settings.served_models[0],
            max_tokens=400,
            stream=streamed,
            extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": "Write a long story about a dragon."}],
        )
        stopping = asyncio.create_task(stop_once_writing())
        with pytest.raises(openai.APIError) as stopped:
            answer = await call
            if isinstance(answer, openai.AsyncStream):
                async for _ in answer:
                    pass
        await stopping
        listed = (await http.get("/v1/conversations", headers=headers)).json()["data"]
    assert len(listed) == 1, "the stopped completion was sent again"
    assert stopped.value.code == "cancelled", stopped.value
    if not streamed:
        assert isinstance(stopped.value, openai.ConflictError)
        assert stopped.value.request_id  # the id it is logged under


async def test_the_turns_of_one_api_chat_go_to_one_partition(stack: Stack) -> None:
    """Each API call is a conversation of its own, and the conversation picked the
    partition: the turns of one chat went to partitions at random, away from the worker
    whose prefix cache held their history. A `prompt_cache_key` picks it where given."""
    model = stack.settings.served_models[0]
    turns: list[tuple[str, str]] = []  # each chat's first and second turn
    async with client(stack, await api_key(stack)) as api:
        for chat in range(4):
            opening: list[ChatCompletionMessageParam] = [
                {"role": "system", "content": f"Chat {chat}, {uuid.uuid4().hex}."},
                {"role": "user", "content": "Name a colour."},
            ]
            first = await api.chat.completions.create(model=model, messages=opening, max_tokens=4)
            answer = first.choices[0].message.content or ""
            follow: list[ChatCompletionMessageParam] = [
                *opening,
                {"role": "assistant", "content": answer},
                {"role": "user", "content": "And another?"},
            ]
            second = await api.chat.completions.create(model=model, messages=follow, max_tokens=4)
            turns.append((first.id, second.id))
        key = f"key-{uuid.uuid4().hex}"
        keyed = [  # two unrelated chats, one key
            await api.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": question}],
                max_tokens=4,
                prompt_cache_key=key,
            )
            for question in ("Name a fruit.", "Name a tree.")
        ]
    partitions = [(queued_in(stack, a), queued_in(stack, b)) for a, b in turns]
    assert all(a == b for a, b in partitions), partitions
    assert queued_in(stack, keyed[0].id) == queued_in(stack, keyed[1].id)


def queued_in(stack: Stack, completion_id: str) -> int:
    """The partition the gateway logged the completion's prompt queued in."""
    request_id = completion_id.removeprefix("chatcmpl-")
    by_role = lines_about(request_id, list(stack.gateways))
    said = " ".join(line for lines in by_role.values() for line in lines)
    found = re.search(r"queued chat prompt .*partition (\d+)", said)
    assert found, said
    return int(found.group(1))
