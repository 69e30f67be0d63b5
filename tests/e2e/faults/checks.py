"""The one assertion every fault test ends with: each conversation is complete, in
order and without duplicates, through the API and in Cassandra, and what each client
saw is what was stored."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

from schemas.events import ANSWERED
from tandoor.clients import cassandra_session
from tandoor.settings import Settings
from tests.e2e.faults.driver import MAX_TOKENS, ChatClient, Turn
from tests.e2e.stack import Stack
from tests.waiting import eventually, until


async def mid_stream(users: list[ChatClient], count: int) -> None:
    """Until `count` clients are receiving tokens."""
    try:
        await until(
            lambda: sum(u.streaming.is_set() for u in users),
            lambda streaming: streaming >= count,
            what=f"{count} clients receiving tokens",
            poll_s=0.05,
        )
    except AssertionError as exc:
        seen = [turn.seen() for user in users for turn in user.turns[-1:]]
        raise AssertionError(f"{exc}; the clients saw {seen}") from exc


async def assert_conversations_complete(stack: Stack, users: list[ChatClient]) -> None:
    for user in users:
        messages = await _all_replies_stored(user)
        check_conversation(user, messages)
        rows = await asyncio.to_thread(_stored_rows, stack.settings, user.conversation)
        assert rows == [(m["id"], m["role"], m["content"], m["status"]) for m in messages]
        usage = await asyncio.to_thread(completion_tokens, stack.settings, user.name)
        # Usage is keyed by request: a replay cannot double it, a lost write shows here.
        # (The conversation's title job is charged too.)
        missing = {t.request_id for t in user.turns} - set(usage)
        assert not missing, f"{user.name}: no usage stored for {missing}"
        told = {  # what the client's final said (one read from history says nothing)
            t.request_id: t.final["usage"]["completion_tokens"]
            for t in user.turns
            if t.request_id is not None and t.final is not None and "usage" in t.final
        }
        stored = {request_id: usage[request_id] for request_id in told}
        assert stored == told, f"{user.name}: usage stored unlike the replies' finals"


def check_conversation(user: ChatClient, messages: list[dict[str, Any]]) -> None:
    ids = [m["id"] for m in messages]
    assert len(set(ids)) == len(ids), f"{user.name}: duplicate messages {ids}"
    times = [dt.datetime.fromisoformat(m["created_at"]) for m in messages]  # not as text:
    # "...:01Z" sorts after "...:01.001000Z"
    assert times == sorted(times) and len(set(times)) == len(times), (
        f"{user.name}: order {[(m['role'], m['status'], m['created_at']) for m in messages]}"
    )
    failed = [m for m in messages if m["role"] == "user" and m["status"] == "failed"]
    refused = sum(t.refused.count(503) for t in user.turns)
    assert len(failed) <= refused, f"{user.name}: messages failed without a 503: {failed}"
    shown = [m for m in messages if m not in failed]
    assert [m["role"] for m in shown] == ["user", "assistant"] * len(user.turns), (
        f"{user.name}: not one reply per message: {[(m['role'], m['status']) for m in shown]}"
    )
    pairs = zip(shown[::2], shown[1::2], strict=True)
    for turn, (asked, answer) in zip(user.turns, pairs, strict=True):
        check_turn(user.name, turn, asked, answer)


def check_turn(name: str, turn: Turn, asked: dict[str, Any], answer: dict[str, Any]) -> None:
    assert (asked["content"], asked["status"]) == (turn.content, "sent"), (name, asked)
    assert turn.final is not None and turn.final["finish_reason"] in ANSWERED, (name, turn)
    assert answer["id"] == turn.request_id, (name, answer, turn)
    assert answer["status"] == "complete" and answer["finish_reason"] in ANSWERED, (name, answer)
    assert answer["attempt"] == turn.final["attempt"], (name, answer, turn.final)
    assert answer["content"] and answer["content"] == turn.text, (name, answer, turn.text)


async def _all_replies_stored(user: ChatClient) -> list[dict[str, Any]]:
    """The conversation once a reply is stored for every turn (persist may lag)."""

    async def messages() -> list[dict[str, Any]]:
        return list((await user.open())["messages"])

    return await eventually(
        messages,
        lambda stored: sum(m["role"] == "assistant" for m in stored) >= len(user.turns),
        what=f"{user.name}'s replies stored",
    )


def _stored_rows(settings: Settings, conversation: str) -> list[tuple[str, str, str, str]]:
    with cassandra_session(settings, settings.keyspace) as session:
        rows = session.execute(
            "SELECT message_id, role, content, status FROM messages_by_conversation "
            "WHERE conversation_id = %s",
            (conversation,),
        )
        return [(r.message_id, r.role, r.content, r.status) for r in rows]


def completion_tokens(settings: Settings, user_id: str) -> dict[str, int]:
    """The user's stored usage: completion tokens by request id."""
    today = dt.datetime.now(dt.UTC).date()
    with cassandra_session(settings, settings.keyspace) as session:
        rows = session.execute(
            "SELECT request_id, completion_tokens FROM usage_by_user_day "
            "WHERE user_id = %s AND day IN (%s, %s)",
            (user_id, today - dt.timedelta(days=1), today),
        )
        return {r.request_id: r.completion_tokens for r in rows}


def check_continued_stream(turn: Turn) -> None:
    """One reply as if no worker had died: no restart, every event of attempt 1, and the
    whole reply (ignore_eos) counted once."""
    kinds = [kind for kind, _ in turn.events]
    assert "restart" not in kinds, turn.events
    assert all(attempt == 1 for kind, attempt in turn.events if kind in ("token", "final"))
    assert kinds[-1] == "final" and turn.final is not None
    assert turn.final["finish_reason"] == "length", turn.final
    assert turn.final["usage"]["completion_tokens"] == MAX_TOKENS, turn.final
