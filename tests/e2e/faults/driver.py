"""A client-side driver for the fault tests: several users chatting at once over SSE,
each behaving as the chat page does when things break.

- A stream that breaks is resumed with `Last-Event-ID` on the next replica (any
  replica can serve it); a `restart` event drops the partial text.
- A send is retried only when it cannot have been taken: the connection was refused,
  or the answer was a 503/429 (wait `Retry-After`). When the request may have reached
  the gateway (the connection broke before the `start` event), the client reopens the
  conversation first and follows the message it finds instead of sending it again.
- If the reply ended before the client got back (a resume answers 404), the client
  shows the stored reply, as reopening the chat does.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any

import httpx

from tandoor.policies.api_keys import create_key
from tests.e2e.helpers import sse, user_name
from tests.e2e.stack import Stack
from tests.waiting import eventually, while_progressing

RETRY_S = 0.5  # before trying the next replica
MAX_TOKENS = 40


class Retry(Exception):
    """Try again after `delay_s`: nothing was taken."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(f"retry in {delay_s} s")
        self.delay_s = delay_s


@dataclass
class Turn:
    content: str
    request_id: str | None = None
    text: str = ""  # what the client shows, after any restart
    last_event_id: str | None = None
    attempt: int = 0  # of the text shown
    final: dict[str, Any] | None = None
    restarts: int = 0
    resumes: int = 0  # streams reopened with Last-Event-ID
    refused: list[int] = field(default_factory=list)  # 503/429 answers before it was taken
    last_refusal: str = ""  # its message, for a failure to show
    from_history: bool = False  # the reply ended while the client was away
    events: list[tuple[str, int]] = field(default_factory=list)  # (type, attempt) as read

    @property
    def done(self) -> bool:
        return self.final is not None

    def seen(self) -> str:
        """What the client got so far, for a failure to show."""
        kinds = [kind for kind, _ in self.events]
        return f"{self.request_id}: {kinds[:3]}..., refused {self.refused} {self.last_refusal}"

    def progress(self) -> tuple[int, bool, int, int, int]:
        """What changes as the turn moves on, as the client sees it."""
        return (len(self.text), self.done, self.restarts, self.resumes, len(self.refused))


@dataclass
class ChatClient:
    name: str
    headers: dict[str, str]
    conversation: str
    urls: list[str]
    turns: list[Turn] = field(default_factory=list)
    streaming: asyncio.Event = field(default_factory=asyncio.Event)  # tokens are flowing

    def __post_init__(self) -> None:
        self._replicas = itertools.cycle(range(len(self.urls)))
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(60, connect=5))

    async def aclose(self) -> None:
        await self._http.aclose()

    def _next_url(self) -> str:
        return self.urls[next(self._replicas)]

    async def chat(self, count: int, max_tokens: int = MAX_TOKENS) -> None:
        for i in range(count):
            await self.send(f"{self.name}, turn {i}: count from one to twenty.", max_tokens)

    async def send(self, content: str, max_tokens: int = MAX_TOKENS) -> Turn:
        turn = Turn(content)
        self.turns.append(turn)
        body = {"content": content, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        while not await self._post(turn, body):
            pass
        while not turn.done:
            await self._resume(turn)
        self.streaming.clear()
        return turn

    async def _post(self, turn: Turn, body: dict[str, Any]) -> bool:
        """True once the message was taken (its reply may still be running)."""
        url = self._next_url()
        path = f"{url}/v1/conversations/{self.conversation}/messages"
        try:
            async with self._http.stream("POST", path, json=body, headers=self.headers) as r:
                await _refused(r, turn)
                await self._read(r, turn)
            return True
        except Retry as retry:
            await asyncio.sleep(retry.delay_s)
            return False
        except httpx.ConnectError:  # nothing reached the replica
            await asyncio.sleep(RETRY_S)
            return False
        except httpx.TransportError:
            return turn.request_id is not None or await self._adopt(turn)

    async def _adopt(self, turn: Turn) -> bool:
        """The request may have been taken: find its message instead of sending again."""
        taken, reply = _answer_to(await self.open(), turn.content)
        if reply is not None:
            self._from_history(turn, reply)
        return taken

    async def _resume(self, turn: Turn) -> None:
        url = self._next_url()
        path = f"{url}/v1/conversations/{self.conversation}/stream"
        headers = dict(self.headers)
        if turn.last_event_id is not None:
            headers["Last-Event-ID"] = turn.last_event_id
        try:
            async with self._http.stream("GET", path, headers=headers) as r:
                if r.status_code == 404:  # no reply running: it ended while we were away
                    await self._stored(turn)
                    return
                await _refused(r, turn)
                turn.resumes += 1
                await self._read(r, turn)
        except Retry as retry:
            await asyncio.sleep(retry.delay_s)
        except httpx.TransportError:
            await asyncio.sleep(RETRY_S)

    async def _read(self, response: httpx.Response, turn: Turn) -> None:
        async for event_id, data in sse(response):
            turn.last_event_id = event_id or turn.last_event_id
            if data == "[DONE]":
                return
            kind = data["type"]
            turn.events.append((kind, data.get("attempt", 0)))
            if kind == "start":
                turn.request_id = data["request_id"]
            elif kind == "restart":
                turn.text, turn.restarts = "", turn.restarts + 1
            elif kind == "token":
                turn.text, turn.attempt = turn.text + data["delta"], data["attempt"]
                self.streaming.set()
            elif kind == "final":
                turn.final, turn.request_id = data, data["request_id"]
            elif kind == "error":
                raise AssertionError(f"{self.name}: error event {data}")

    async def _stored(self, turn: Turn) -> None:
        """The reply as reopening the chat shows it, once the persistence consumer has it."""

        async def stored_reply() -> dict[str, Any] | None:
            return _answer_to(await self.open(), turn.content)[1]

        reply = await eventually(stored_reply, what=f"{self.name}'s stored reply")
        assert reply is not None
        self._from_history(turn, reply)

    def _from_history(self, turn: Turn, reply: dict[str, Any]) -> None:
        if reply["attempt"] == turn.attempt:  # what was shown must be where it starts
            assert reply["content"].startswith(turn.text), (turn.text, reply)
        turn.request_id, turn.text, turn.from_history = reply["id"], reply["content"], True
        turn.final = {"finish_reason": reply["finish_reason"], "attempt": reply["attempt"]}

    async def open(self) -> dict[str, Any]:
        """The conversation, from whichever replica answers."""
        while True:
            url = self._next_url()
            with contextlib.suppress(httpx.TransportError):
                r = await self._http.get(
                    f"{url}/v1/conversations/{self.conversation}", headers=self.headers
                )
                if r.status_code == 200:
                    return dict(r.json())
            await asyncio.sleep(RETRY_S)


async def _refused(response: httpx.Response, turn: Turn) -> None:
    """A 503 or 429 before anything was taken: wait as told. Anything else but 200 is a
    failure of the test."""
    if response.status_code in (429, 503):
        turn.last_refusal = (await response.aread()).decode(errors="replace")[:200]
        turn.refused.append(response.status_code)
        raise Retry(float(response.headers.get("Retry-After", "1")))
    if response.status_code != 200:
        raise AssertionError(f"{response.status_code}: {(await response.aread()).decode()}")


@contextlib.asynccontextmanager
async def chatting(users: list[ChatClient], turns: int) -> AsyncIterator[asyncio.TaskGroup]:
    """The users chat `turns` turns each while the body runs; leaving waits for every
    chat to end (and cancels them if the body failed)."""
    async with asyncio.TaskGroup() as group:
        for user in users:
            group.create_task(user.chat(turns), name=user.name)
        yield group


def watching(stack: Stack, users: list[ChatClient], what: str) -> AbstractAsyncContextManager[None]:
    """Fails the body once nothing has moved for a while: no client saw anything new and
    the worker logged nothing (a replacement worker starts unseen by the clients)."""
    return while_progressing(
        lambda: (
            tuple(turn.progress() for user in users for turn in user.turns),
            stack.worker.log_size(),
        ),
        what,
    )


async def chat_all(users: list[ChatClient], turns: int) -> None:
    async with chatting(users, turns):
        pass


@contextlib.asynccontextmanager
async def clients(stack: Stack, count: int, tier: str = "plus") -> AsyncIterator[list[ChatClient]]:
    """`count` users, each with a new conversation, spread over the replicas."""
    made: list[ChatClient] = []
    try:
        for i in range(count):
            key, principal = await create_key(stack.settings, user_name(f"fault{i}"), tier)
            headers = {"Authorization": f"Bearer {key}"}
            urls = stack.urls[i % len(stack.urls) :] + stack.urls[: i % len(stack.urls)]
            async with httpx.AsyncClient(base_url=urls[0], timeout=30) as http:
                created = await http.post("/v1/conversations", json={}, headers=headers)
                assert created.status_code == 201, created.text
            made.append(ChatClient(principal.user_id, headers, created.json()["id"], urls))
        yield made
    finally:
        for client in made:
            await client.aclose()


def _answer_to(opened: dict[str, Any], content: str) -> tuple[bool, dict[str, Any] | None]:
    """Whether the conversation took the message `content`, and its reply if stored."""
    messages = opened["messages"]
    sent = [i for i, m in enumerate(messages) if m["role"] == "user" and m["status"] != "failed"]
    if not sent or messages[sent[-1]]["content"] != content:
        return False, None
    after = messages[sent[-1] + 1 :]
    return True, (after[0] if after and after[0]["role"] == "assistant" else None)
