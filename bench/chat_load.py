"""Chat load shapes over the gateway: users with API keys, an open loop at a fixed
rate, a closed-loop flood, and what came back."""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from bench.chat_client import ChatError, ChatUser, ReplyTimes, timed_reply
from bench.loadgen import question
from tandoor.clients import cassandra_session, redis_client
from tandoor.policies.api_keys import KeyStore
from tandoor.settings import Settings

SHOWN_ERRORS = 5  # the first few are printed; all are counted
ERROR_PAUSE_S = 1.0


async def make_users(
    settings: Settings, client: httpx.AsyncClient, tier: str, count: int, tag: str
) -> list[ChatUser]:
    """`count` users of `tier`, one key each (one Cassandra session for them all)."""
    cache = redis_client(settings)
    try:
        with cassandra_session(settings, settings.keyspace) as session:
            store = KeyStore(session, cache, set(settings.tiers))
            keys = [await store.create(f"{tag}-{tier}-{i}", tier) for i in range(count)]
    finally:
        await cache.aclose()
    return [ChatUser(client, key) for key, _ in keys]


@dataclass
class Turns:
    """One user's conversations, each used for up to `turns` replies, one at a time:
    short chats, so the context stays small and steady."""

    user: ChatUser
    model: str
    turns: int
    idle: list[tuple[str, int]] = field(default_factory=list)

    async def take(self) -> tuple[str, int]:
        return self.idle.pop() if self.idle else (await self.user.conversation(self.model), 0)

    def give_back(self, conversation: str, used: int) -> None:
        if used < self.turns:
            self.idle.append((conversation, used))


@dataclass
class Outcomes:
    replies: list[tuple[float, ReplyTimes]] = field(default_factory=list)  # (ended at, times)
    errors: int = 0

    def ttft_ms(self, pct: int, since: float = 0.0, until: float = float("inf")) -> float:
        return percentile([t.ttft_s * 1000 for at, t in self.replies if since <= at < until], pct)

    def total_ms(self, pct: int) -> float:
        return percentile([t.total_s * 1000 for _, t in self.replies], pct)

    def part_ms(self, pct: int, part: Callable[[ReplyTimes], float]) -> float:
        return percentile([part(t) * 1000 for _, t in self.replies], pct)


def percentile(values: list[float], pct: int) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[pct - 1]


async def one_reply(turns: Turns, i: int, max_tokens: int, out: Outcomes) -> bool:
    try:
        conversation, used = await turns.take()
        times = await timed_reply(turns.user, conversation, question(i), max_tokens)
        turns.give_back(conversation, used + 1)
        out.replies.append((time.monotonic(), times))
        return True
    except (ChatError, httpx.HTTPError) as exc:  # counted and shown; the load goes on
        out.errors += 1
        if out.errors <= SHOWN_ERRORS:
            print(f"  error: {exc!r}", file=sys.stderr)
        return False


async def open_loop(
    users: list[Turns], rate: float, duration_s: float, max_tokens: int, out: Outcomes
) -> None:
    """A request every 1/rate s, round-robin over users, whether or not earlier ones
    have finished; then waits for those in flight."""
    tasks: set[asyncio.Task[bool]] = set()
    started, i = time.monotonic(), 0
    while time.monotonic() - started < duration_s:
        task = asyncio.create_task(one_reply(users[i % len(users)], i, max_tokens, out))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        i += 1
        await asyncio.sleep(max(0.0, started + i / rate - time.monotonic()))
    await asyncio.gather(*tasks)


async def closed_loop(turns: Turns, max_tokens: int, stop: asyncio.Event, out: Outcomes) -> None:
    """One user asking again as soon as each reply ends, until `stop`."""
    i = 0
    while not stop.is_set():
        if not await one_reply(turns, i, max_tokens, out):
            await asyncio.sleep(ERROR_PAUSE_S)  # a refusal is quick: do not spin on it
        i += 1
