"""A conversation's Cassandra rows, and the times and cursors they are keyed by."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import Any

from producers.gateway.conversations.protocol import Conversation, Message
from producers.gateway.errors import ApiError, count
from schemas.events import MessageKey

Row = tuple[str, tuple[object, ...]]


def conversation_row(user_id: str, conversation: Conversation) -> Row:
    """Without a title, none is written: a null is a tombstone, which a first message's
    title written as of a moment no later (another gateway's clock) did not outlast."""
    titled = conversation.title is not None
    columns = "conversation_id, user_id, model, created_at, updated_at" + (
        ", title" if titled else ""
    )
    values = (
        conversation.id,
        user_id,
        conversation.model,
        conversation.created_at,
        conversation.updated_at,
        *((conversation.title,) if titled else ()),
    )
    marks = ", ".join(["%s"] * len(values))
    return (f"INSERT INTO conversations ({columns}) VALUES ({marks})", values)


def user_message_row(
    conversation: Conversation,
    at: dt.datetime,
    message_id: str,
    content: str,
    status: str = "sent",
) -> Row:
    return (
        "INSERT INTO messages_by_conversation (conversation_id, created_at, message_id, "
        "role, content, status, model) VALUES (%s, %s, %s, 'user', %s, %s, %s)",
        (conversation.id, at, message_id, content, status, conversation.model),
    )


def moved_to_top(user_id: str, conversation: Conversation, at: dt.datetime) -> list[Row]:
    """Its time, its new sidebar row, and the old row gone: together, or a sidebar row
    left without its time would hide the conversation (rows that do not match it are
    passed over)."""
    rows = [
        (
            "UPDATE conversations SET updated_at = %s WHERE conversation_id = %s",
            (at, conversation.id),
        ),
        sidebar_row(user_id, conversation.model_copy(update={"updated_at": at})),
    ]
    if conversation.updated_at != at:  # else the old sidebar row is the new one
        rows.append(sidebar_row_deleted(user_id, conversation.updated_at, conversation.id))
    return rows


def title_row(conversation_id: str, title: str | None, as_of_ms: int | None = None) -> Row:
    """The title; written as of `as_of_ms` when given (when the gateway or the title job
    read the conversation untitled or unrenamed), so that a title the user set later is
    kept: written at the time of the write, it replaced the user's rename."""
    if as_of_ms is None:
        return (
            "UPDATE conversations SET title = %s WHERE conversation_id = %s",
            (title, conversation_id),
        )
    return (
        "UPDATE conversations USING TIMESTAMP %s SET title = %s WHERE conversation_id = %s",
        (as_of_ms * 1000, title, conversation_id),
    )


def sidebar_row(user_id: str, conversation: Conversation) -> Row:
    """The sidebar row, clustered by updated_at (newest first)."""
    return (
        "INSERT INTO conversations_by_user (user_id, updated_at, conversation_id, "
        "model, title) VALUES (%s, %s, %s, %s, %s)",
        (user_id, conversation.updated_at, conversation.id, conversation.model, conversation.title),
    )


def sidebar_row_deleted(user_id: str, updated_at: dt.datetime, conversation_id: str) -> Row:
    return (
        "DELETE FROM conversations_by_user WHERE user_id = %s AND updated_at = %s "
        "AND conversation_id = %s",
        (user_id, updated_at, conversation_id),
    )


def conversation_erased(
    user_id: str, conversation_id: str, sidebar_times: Iterable[dt.datetime]
) -> list[Row]:
    """Its messages, its sidebar rows of those times and the conversation, as one batch."""
    return [
        ("DELETE FROM messages_by_conversation WHERE conversation_id = %s", (conversation_id,)),
        *(sidebar_row_deleted(user_id, at, conversation_id) for at in sidebar_times),
        ("DELETE FROM conversations WHERE conversation_id = %s", (conversation_id,)),
    ]


def conversation_of(conversation_id: str, row: Any) -> Conversation:
    return Conversation(
        id=conversation_id,
        model=row.model,
        title=row.title,
        created_at=utc(row.created_at),
        updated_at=utc(row.updated_at),
    )


def utc_now() -> dt.datetime:
    now = dt.datetime.now(dt.UTC)
    return now.replace(microsecond=now.microsecond // 1000 * 1000)  # Cassandra keeps ms


def utc(value: dt.datetime) -> dt.datetime:
    return value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value


def to_ms(value: dt.datetime) -> int:
    return int(utc(value).timestamp() * 1000)


def message_key(message: Message) -> MessageKey:
    since_epoch = utc(message.created_at) - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
    return MessageKey(
        created_at_ms=since_epoch // dt.timedelta(milliseconds=1), message_id=message.id
    )


def from_ms(ms: int) -> dt.datetime:
    return dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(milliseconds=ms)


MAX_CURSOR_MS = 253_402_300_800_000  # year 10000: past it is no time a cursor can hold


def parse_cursor(cursor: str | None) -> tuple[dt.datetime, str] | None:
    if cursor is None:
        return None
    ms, sep, conversation_id = cursor.partition("~")
    at = count(ms, MAX_CURSOR_MS)
    if not sep or at is None or not conversation_id:
        raise ApiError(400, "cursor: not a value from next_cursor", param="cursor")
    return from_ms(at), conversation_id
