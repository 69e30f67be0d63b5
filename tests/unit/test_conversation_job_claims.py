"""A conversation's title is asked for once, and a failure does not use up that once; a
summary is asked for once at a time. Redis or Cassandra failing in a reply's last step
was logged as "settling the finished reply failed" on every reply (the reply had been
settled), and a job that got no answer kept its claim for 30 days: the chat kept its
opening words as its name for good."""

from __future__ import annotations

import asyncio
import datetime as dt
from types import SimpleNamespace
from typing import Any, cast

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from producers.gateway.chat.jobs import JOB_WAIT_S, ConversationJobs
from producers.gateway.conversations.protocol import Conversation, Message
from schemas.events import PromptRequest, now_ms
from tandoor.policies.redis_keys import titled_key

AT = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
UNTITLED = Conversation(id="c1", model="m", title=None, created_at=AT, updated_at=AT)


class Redis:
    def __init__(self, down: bool = False) -> None:
        self.down = down
        self.keys: set[str] = set()

    async def set(self, key: str, *_: object, nx: bool = False, **__: object) -> bool:
        if self.down:
            raise RedisConnectionError("refused")
        if nx and key in self.keys:
            return False
        self.keys.add(key)
        return True

    async def delete(self, key: str) -> int:
        if self.down:
            raise RedisConnectionError("refused")
        self.keys.discard(key)
        return 1


def jobs_with(redis: Redis, answers: list[str | None]) -> tuple[ConversationJobs, list[str]]:
    """Jobs whose model answers `answers` in turn (None: no answer); and the ids asked."""
    renamed = SimpleNamespace(title=None)
    conversations = SimpleNamespace(
        owned=lambda *_: _now(renamed), rename=lambda *_, **__: _now(None)
    )
    checks = SimpleNamespace(moderator=None, fits=lambda *_: True)
    jobs = ConversationJobs(
        cast(Any, None),
        cast(Any, None),
        cast(Any, conversations),
        cast(Any, redis),
        cast(Any, checks),
    )
    asked: list[str] = []

    async def ask(job: Any, *_: object) -> str | None:
        asked.append(job.request_id)
        return answers.pop(0)

    jobs._ask = ask  # type: ignore[method-assign,assignment]
    return jobs, asked


async def _now(value: object) -> object:
    return value


async def settled(jobs: ConversationJobs) -> None:
    while len(jobs._tasks):
        await asyncio.gather(*jobs._tasks)


async def test_redis_down_at_a_reply_end_is_no_error_of_the_reply(
    caplog: pytest.LogCaptureFixture,
) -> None:
    jobs, asked = jobs_with(Redis(down=True), ["A title"])
    await jobs.after_reply("u", UNTITLED, "Hi", "Hello")  # does not raise
    await settled(jobs)
    assert asked == []


async def test_a_title_job_without_an_answer_is_asked_again_after_the_next_reply() -> None:
    redis = Redis()
    jobs, asked = jobs_with(redis, [None, "Greetings"])
    await jobs.after_reply("u", UNTITLED, "Hi", "Hello")
    await settled(jobs)
    assert titled_key("c1") not in redis.keys  # the failed try gave its claim back
    await jobs.after_reply("u", UNTITLED, "Hi", "Hello")
    await settled(jobs)
    assert len(asked) == 2 and asked[0] != asked[1], asked  # a new id: the first is done
    assert titled_key("c1") in redis.keys
    await jobs.after_reply("u", UNTITLED, "Hi", "Hello")
    await settled(jobs)
    assert len(asked) == 2  # answered once: never asked again


async def test_one_summary_at_a_time_per_conversation() -> None:
    jobs, _ = jobs_with(Redis(), [])
    started: list[str] = []
    release = asyncio.Event()

    async def summary(*args: object) -> None:
        started.append("job")
        await release.wait()

    jobs._summary = summary  # type: ignore[method-assign,assignment]
    turn = Message(id="m1", role="user", content="Hello", status="sent", created_at=AT)
    for _ in range(3):
        jobs.after_context_cut("u", UNTITLED, None, [turn])
    assert len(jobs._tasks) == 1
    release.set()
    await settled(jobs)
    jobs.after_context_cut("u", UNTITLED, None, [turn])  # the next cut asks again
    assert len(jobs._tasks) == 1
    release.set()
    await settled(jobs)
    assert started == ["job", "job"]


async def test_a_job_prompt_expires_when_nobody_waits_for_it_any_more() -> None:
    sent: list[PromptRequest] = []

    async def submit(prompt: PromptRequest, *_: object) -> None:
        sent.append(prompt)
        raise TimeoutError  # stands for the answer not coming

    subscription = SimpleNamespace(partition=0, queue=asyncio.Queue())
    fanout = SimpleNamespace(subscribe=lambda _: _now(subscription), unsubscribe=lambda _: None)
    checks = SimpleNamespace(moderator=None, fits=lambda *_: True)
    jobs = ConversationJobs(
        cast(Any, fanout),
        cast(Any, SimpleNamespace(submit=submit)),
        cast(Any, None),
        cast(Any, None),
        cast(Any, checks),
    )
    job = SimpleNamespace(kind="title", request_id="t1", instruction="i", content="c", max_tokens=4)
    before = now_ms()
    assert await jobs._ask(cast(Any, job), UNTITLED, "u") is None
    (prompt,) = sent
    assert prompt.deadline_ms is not None
    assert before + JOB_WAIT_S * 1000 <= prompt.deadline_ms <= now_ms() + JOB_WAIT_S * 1000


async def test_each_summary_try_has_its_own_request_id() -> None:
    """The id was the conversation's and the cut's: a try that expired unrun left its
    done mark, and the next try of the same cut was dropped by the workers unanswered."""
    jobs, asked = jobs_with(Redis(), [None, None])
    turn = Message(id="m1", role="user", content="Hello", status="sent", created_at=AT)
    for _ in range(2):
        await jobs._summary("u", UNTITLED, None, [turn], False)
    assert len(set(asked)) == 2, asked
