"""Membership chaos: 32 replies at once, half through the chat API and half through the
OpenAI API, while the worker group goes 1 → 3 → 1 (one leaves with SIGTERM, one is
killed -9 while generating, in an order the seed picks) and a gateway replica joins
and leaves with SIGTERM. For every request: it completes, what its client saw is the
stored text, one final is shown, and its tokens are counted once; no role exits
unexpectedly. Replies the killed worker had under way are continued by another, with
no restart and no repeated or missing text.

The seed is printed on failure; TANDOOR_CHAOS_SEED=<seed> runs the same choices again."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from infra.process import free_port
from infra.roles import GatewayProcess, RoleProcess, WorkerProcess
from schemas.events import ANSWERED
from tandoor.clients import redis_client
from tandoor.policies.api_keys import create_key
from tandoor.policies.redis_keys import lease_key
from tandoor.settings import Settings
from tests.e2e.faults.checks import (
    assert_conversations_complete,
    check_continued_stream,
    completion_tokens,
    mid_stream,
)
from tests.e2e.faults.driver import MAX_TOKENS, ChatClient, clients
from tests.e2e.helpers import sse, user_name
from tests.e2e.stack import Stack
from tests.ops import samples
from tests.waiting import eventually, while_progressing

pytestmark = pytest.mark.integration

SEED = int(os.environ.get("TANDOOR_CHAOS_SEED", random.randrange(2**32)))
CHAT_USERS = API_USERS = 16
CONTINUED = re.compile(r"(\w+) attempt \d+ continues attempt \d+")
# A reply that had ended just as its worker was killed: the next one finds its final.
FOUND_FINAL = re.compile(r"(\w+):? (?:already has a final reply|delivering the final)")


@dataclass
class ApiTurn:
    request_id: str = ""
    text: str = ""
    finishes: list[str] = field(default_factory=list)
    errors: list[Any] = field(default_factory=list)
    usage: dict[str, Any] | None = None


@dataclass
class ApiClient:
    """An OpenAI-API client that streams completion after completion, as an SDK would
    with retries on refused connections and 503s (nothing was taken then)."""

    name: str
    user_id: str
    model: str
    headers: dict[str, str]
    urls: list[str]
    turns: list[ApiTurn] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=5)) as http:
            for i in range(1000):
                if self.stop.is_set():
                    return
                turn = ApiTurn()
                self.turns.append(turn)
                while not await self._complete(http, self.urls[i % len(self.urls)], turn, i):
                    i += 1
                    await asyncio.sleep(0.5)

    async def _complete(self, http: httpx.AsyncClient, url: str, turn: ApiTurn, i: int) -> bool:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": f"{self.name} asks {i}: name ten fruits."}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        try:
            async with http.stream(
                "POST", f"{url}/v1/chat/completions", json=body, headers=self.headers
            ) as response:
                if response.status_code in (429, 503):
                    await response.aread()
                    return False
                assert response.status_code == 200, (response.status_code, await response.aread())
                async for _, data in sse(response):
                    self._read(turn, data)
        except httpx.ConnectError:
            return False
        except httpx.TransportError:  # a pooled connection the leaving replica closed
            if turn.request_id:
                raise  # the stream broke mid-reply: an OpenAI stream cannot resume
            return False
        return True

    def _read(self, turn: ApiTurn, chunk: Any) -> None:
        if chunk == "[DONE]":
            return
        if "error" in chunk:
            turn.errors.append(chunk["error"])
            return
        turn.request_id = chunk["id"].removeprefix("chatcmpl-")
        if chunk.get("usage"):
            turn.usage = chunk["usage"]
        for choice in chunk["choices"]:
            turn.text += choice["delta"].get("content") or ""
            if choice["finish_reason"]:
                turn.finishes.append(choice["finish_reason"])


async def test_workers_and_gateways_come_and_go_under_32_replies(stack: Stack) -> None:
    choose = random.Random(SEED)
    print(f"chaos seed {SEED} (TANDOOR_CHAOS_SEED={SEED} repeats it)")
    # It drains for as long as its OpenAI streams take (under this load, more than the
    # default 30 s, after which they would be cut): they cannot resume elsewhere.
    spare = GatewayProcess(
        stack.logs, free_port(), {**stack.env, "TANDOOR_GATEWAY_DRAIN_S": "3600"}
    )
    spare_url = f"http://127.0.0.1:{spare.port}"
    # vLLM binds every engine of a machine to the same cores ("auto"): a joining engine
    # would get a sliver of the busy one's core and take many minutes to start.
    unbound = {**stack.env, "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    joined = [WorkerProcess(stack.model, stack.logs, unbound) for _ in range(2)]
    async with (
        clients(stack, CHAT_USERS) as chat_users,
        api_clients(stack, API_USERS, spare_url) as api_users,
    ):
        for user in chat_users:  # until it starts, a connection there is refused: next one
            user.urls.append(spare_url)
        every = [stack.worker, *joined, spare, stack.persist, *stack.gateways]
        progress = lambda: (  # noqa: E731
            tuple(len(t.text) for u in api_users for t in u.turns),
            tuple(turn.progress() for user in chat_users for turn in user.turns),
            tuple(role.log_size() for role in every),
        )
        try:
            async with while_progressing(progress, f"chaos (seed {SEED})"):
                cut = await chaos(stack, choose, chat_users, api_users, joined, spare)
        finally:
            for role in [*joined, spare]:
                role.kill()
                stack.retired.append(role)
        logs = "".join(role.log() for role in [stack.worker, *joined])
        continued, found = set(CONTINUED.findall(logs)), set(FOUND_FINAL.findall(logs))
        print(f"chaos seed {SEED}: {len(cut)} replies cut by the kill, {len(continued)} continued")
        assert cut - found <= continued, f"cut and not continued: {cut - found - continued}"
        for turn in [turn for user in chat_users for turn in user.turns]:
            if turn.request_id in continued and not turn.from_history:
                check_continued_stream(turn)
        await check_every_request(stack, chat_users, api_users)
        for gateway in stack.gateways:  # hand-over and resume readers all closed
            await eventually(
                lambda gateway=gateway: samples(gateway),  # type: ignore[misc]
                lambda now: now.get("tandoor_gateway_token_readers") == 1,
                what=f"{gateway.name} back to its one group reader",
            )
    for role in [stack.worker, stack.persist, *stack.gateways]:
        assert role.alive, f"{role.name} exited:\n{role.log()[-3000:]}"


async def chaos(
    stack: Stack,
    choose: random.Random,
    chat_users: list[ChatClient],
    api_users: list[ApiClient],
    joined: list[WorkerProcess],
    spare: GatewayProcess,
) -> set[str]:
    """The membership changes under load; the replies the kill cut short."""
    stop_chat, cut = asyncio.Event(), set[str]()
    async with asyncio.TaskGroup() as group:
        for user in chat_users:
            group.create_task(chat_until(user, stop_chat))
        for api_user in api_users:
            group.create_task(api_user.run())
        await mid_stream(chat_users, 8)
        for role in [*joined, spare]:  # 1 → 3 workers, 2 → 3 gateways
            role.start()
        await asyncio.gather(*(role.wait_ready() for role in [*joined, spare]))
        for worker in joined:  # each takes part before it goes
            await generating(worker)
        leaving, killed = choose.sample(joined, 2)
        steps = [("sigterm", leaving), ("kill", killed), ("sigterm", spare)]
        choose.shuffle(steps)
        print(f"chaos seed {SEED}: " + ", ".join(f"{how} {role.name}" for how, role in steps))
        for how, role in steps:
            await mid_stream(chat_users, 4)
            if how == "kill":  # with replies of its own under way
                cut = await streaming_from(role, chat_users, api_users)
            await leave(role, how)
        await mid_stream(chat_users, 4)  # the survivors carry on
        stop_chat.set()
        for api_user in api_users:
            api_user.stop.set()
    assert await asyncio.to_thread(leaving.terminate) == 0, leaving.log()[-3000:]
    # uvicorn ends by raising the SIGTERM it handled: the default action, a clean exit.
    assert await asyncio.to_thread(spare.terminate) in (0, -signal.SIGTERM), spare.log()[-3000:]
    return cut


async def streaming_from(
    worker: RoleProcess, chat_users: list[ChatClient], api_users: list[ApiClient]
) -> set[str]:
    """Once a chat client shows text of a reply this worker holds (its lease in Redis
    names the worker's process), the ids of all such replies, the API's too. A chat
    reply among them: only chat clients' continued streams are checked event by event
    (check_continued_stream), and a kill among API streams alone checked none."""
    assert worker.proc is not None
    mark = f":{worker.proc.pid}:".encode()
    redis = redis_client(Settings())

    async def held() -> set[str]:
        shown = [t.request_id for u in chat_users for t in u.turns if t.text and not t.done]
        shown += [c.request_id for u in api_users for c in u.turns if c.text and not c.finishes]
        ids = [i for i in shown if i]
        owners = await redis.mget([lease_key(i) for i in ids]) if ids else []
        return {i for i, owner in zip(ids, owners, strict=True) if owner and mark in owner}

    def with_a_chat(ids: set[str]) -> bool:
        return bool(ids & {turn.request_id for user in chat_users for turn in user.turns})

    try:
        return await eventually(
            held, with_a_chat, what=f"{worker.name} streaming a chat", poll_s=0.05
        )
    finally:
        await redis.aclose()


async def generating(worker: RoleProcess) -> None:
    await eventually(
        lambda: samples(worker),
        lambda now: now.get("tandoor_worker_requests_running", 0) > 0,
        what=f"{worker.name} generating",
        poll_s=0.05,
    )


async def leave(role: RoleProcess, how: str) -> None:
    if how == "kill":
        await asyncio.to_thread(role.kill)
    else:  # its drain goes on while the others serve
        assert role.proc is not None
        role.proc.terminate()


async def chat_until(user: ChatClient, stop: asyncio.Event) -> None:
    for i in range(1000):
        if stop.is_set():
            return
        for replica in range(len(user.urls)):  # every replica in turn, the spare too
            await user.send(f"{user.name}, turn {i}.{replica}: count from one to twenty.")
            if stop.is_set():
                return


@contextlib.asynccontextmanager
async def api_clients(stack: Stack, count: int, spare_url: str) -> AsyncIterator[list[ApiClient]]:
    made = []
    for i in range(count):
        key, principal = await create_key(stack.settings, user_name(f"chaos{i}"), "plus")
        urls = stack.urls[i % 2 :] + stack.urls[: i % 2] + [spare_url]
        headers = {"Authorization": f"Bearer {key}"}
        made.append(ApiClient(f"api{i}", principal.user_id, stack.model, headers, urls))
    yield made


async def check_every_request(
    stack: Stack, chat_users: list[ChatClient], api_users: list[ApiClient]
) -> None:
    for user in chat_users:
        for turn in user.turns:
            if not turn.from_history:
                assert [k for k, _ in turn.events].count("final") == 1, (user.name, turn.events)
                assert turn.final is not None
                assert turn.final["usage"]["completion_tokens"] == MAX_TOKENS, turn.final
    await assert_conversations_complete(stack, chat_users)
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
        for api_user in api_users:
            stored = await stored_api_replies(http, api_user)
            usage = await asyncio.to_thread(completion_tokens, stack.settings, api_user.user_id)
            for call in api_user.turns:
                assert not call.errors, (api_user.name, call)
                assert len(call.finishes) == 1 and call.finishes[0] in ANSWERED, call
                assert stored[call.request_id] == call.text, (api_user.name, call)
                assert call.usage is not None
                assert usage[call.request_id] == call.usage["completion_tokens"], call


async def stored_api_replies(http: httpx.AsyncClient, user: ApiClient) -> dict[str, str]:
    """Each stored API call's reply text, by request id."""
    replies: dict[str, str] = {}
    cursor: str | None = None
    while True:
        params: dict[str, str | int] = {"limit": 100, **({"cursor": cursor} if cursor else {})}
        page = (await http.get("/v1/conversations", params=params, headers=user.headers)).json()
        for conversation in page["data"]:
            path = f"/v1/conversations/{conversation['id']}"
            for message in (await http.get(path, headers=user.headers)).json()["messages"]:
                if message["role"] == "assistant":
                    replies[message["id"]] = message["content"]
        if not (cursor := page["next_cursor"]):
            return replies
