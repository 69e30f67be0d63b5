"""Conversations in Cassandra, every read and write checked against its owner."""

from __future__ import annotations

import datetime as dt
import time
import uuid
from collections.abc import Awaitable, Sequence
from typing import Any, NoReturn

from consumers.history import mark_replaced
from producers.gateway.conversations.protocol import (
    Conversation,
    ConversationPage,
    ConversationWithMessages,
    Message,
)
from producers.gateway.conversations.rows import (
    Row,
    conversation_erased,
    conversation_of,
    conversation_row,
    from_ms,
    moved_to_top,
    parse_cursor,
    sidebar_row,
    title_row,
    to_ms,
    user_message_row,
    utc,
    utc_now,
)
from producers.gateway.errors import UNREACHABLE_RETRY_S, ApiError, not_found, unknown_model
from schemas.events import MessageKey
from tandoor.clients import CASSANDRA_DOWN, cql, cql_pages, cql_together

# A message up to this size goes in one batch with its conversation's rows; Cassandra
# warns of batches over 5 KiB and refuses them over 50 KiB (a message may be 128 KB).
BATCHED_MESSAGE_BYTES = 4096
# Gateways' clocks differ: a message's time (its sidebar row's) may read a little
# earlier than the conversation's creation on another replica.
CLOCK_SKEW = dt.timedelta(minutes=5)
# A summary is written at most this long after the turns it summarizes were read (the
# job drops one that took longer: chat/jobs.py): a turn replaced before that was not in it.
SUMMARY_WRITTEN_WITHIN_S = 720.0


class ConversationService:
    def __init__(self, session: Any, models: Sequence[str]) -> None:
        self._session = session
        self.models = list(models)

    async def create(self, user_id: str, model: str | None, title: str | None) -> Conversation:
        model = model or self.models[0]
        if model not in self.models:
            raise unknown_model(model)
        now = utc_now()
        conversation = Conversation(
            id=f"c_{uuid.uuid4().hex}", model=model, title=title, created_at=now, updated_at=now
        )
        await cql_together(  # listed and readable together, or neither
            self._session,
            [conversation_row(user_id, conversation), sidebar_row(user_id, conversation)],
        )
        return conversation

    async def page(self, user_id: str, limit: int, cursor: str | None) -> ConversationPage:
        """Newest first. A cursor is (updated_at, id) of the last row shown, so rows that
        share a millisecond are neither skipped nor repeated. Sidebar rows that no longer
        match their conversation are passed over (see `_listed`), so a page may take
        several reads to fill."""
        position = parse_cursor(cursor)
        shown: list[tuple[Any, Conversation]] = []
        while len(shown) <= limit:
            wanted = limit + 1 - len(shown)
            rows = await self._sidebar_after(user_id, position, wanted)
            for row in rows:
                conversation = await self._listed(user_id, row)
                if conversation is not None:
                    shown.append((row, conversation))
            if len(rows) < wanted:
                break
            position = (rows[-1].updated_at, rows[-1].conversation_id)
        more = len(shown) > limit
        last = shown[limit - 1][0] if more else None
        next_cursor = f"{to_ms(last.updated_at)}~{last.conversation_id}" if last else None
        return ConversationPage(data=[c for _, c in shown[:limit]], next_cursor=next_cursor)

    async def _listed(self, user_id: str, row: Any) -> Conversation | None:
        """The conversation a sidebar row stands for, or None for a row left behind.
        Moves to the top (a new message) and renames (by hand or by the title job) each
        read the conversation, then rewrite its sidebar row; when they overlap, a row at
        an old updated_at can outlive its delete, and a delete can miss a row a move
        inserts. The conversations table is the truth: only the row at its updated_at is
        shown. Left-behind rows are not deleted here: a row read mid-move, before the
        conversation's new updated_at lands, would look left behind too."""
        current = await self._row(row.conversation_id)
        if current is None or current.user_id != user_id:
            return None
        if utc(current.updated_at) != utc(row.updated_at):
            return None
        return conversation_of(row.conversation_id, current)

    async def _sidebar_after(
        self, user_id: str, cursor: tuple[dt.datetime, str] | None, count: int
    ) -> list[Any]:
        select = "SELECT conversation_id, updated_at FROM conversations_by_user WHERE user_id = %s"
        if cursor is None:
            return await cql(self._session, select + " LIMIT %s", (user_id, count))
        at, last_id = cursor
        same_ms = await cql(
            self._session,
            select + " AND updated_at = %s AND conversation_id > %s LIMIT %s",
            (user_id, at, last_id, count),
        )
        older = await cql(
            self._session, select + " AND updated_at < %s LIMIT %s", (user_id, at, count)
        )
        return [*same_ms, *older][:count]

    async def get(self, user_id: str, conversation_id: str) -> ConversationWithMessages:
        row = await self._owned_row(user_id, conversation_id)
        rows = await cql(
            self._session,
            "SELECT message_id, role, content, status, created_at, model, attempt, "
            "finish_reason, WRITETIME(status) AS status_written "
            "FROM messages_by_conversation WHERE conversation_id = %s",
            (conversation_id,),
        )
        messages = [
            Message(
                id=r.message_id,
                role=r.role,
                content=r.content or "",
                status=r.status,
                created_at=utc(r.created_at),
                model=r.model,
                attempt=r.attempt,
                finish_reason=r.finish_reason,
            )
            for r in rows
            if r.role is not None  # a reply replaced before it was stored (chat/newest.py)
        ]
        return ConversationWithMessages(
            **conversation_of(conversation_id, row).model_dump(),
            messages=messages,
            summary=row.summary,
            summary_until=utc(row.summary_until) if row.summary_until else None,
            summary_stale=summary_stale_by_times(row, rows),
        )

    async def set_summary(
        self, conversation_id: str, text: str, until: dt.datetime, over_stale: bool = False
    ) -> None:
        """Store a summary unless one reaching as far or further is there already (the
        jobs of one conversation are rare and far apart: read, then write, is enough),
        or `over_stale`: the stored one covers turns an edit replaced. Never into a
        conversation deleted meanwhile: the write would bring its row back, unowned,
        holding a summary of what the user deleted."""
        rows = await cql(
            self._session,
            "SELECT summary_until FROM conversations WHERE conversation_id = %s",
            (conversation_id,),
        )
        if not over_stale and rows and rows[0].summary_until:
            if utc(rows[0].summary_until) >= until:
                return
        await cql(
            self._session,
            "UPDATE conversations SET summary = %s, summary_until = %s "
            "WHERE conversation_id = %s IF EXISTS",
            (text, until, conversation_id),
        )

    async def forget_summary(self, conversation_id: str) -> None:
        """An edit replaced turns the summary covers: it must not be shown or used."""
        await cql(
            self._session,
            "UPDATE conversations SET summary = null, summary_until = null "
            "WHERE conversation_id = %s IF EXISTS",
            (conversation_id,),
        )

    async def rename(
        self, user_id: str, conversation_id: str, title: str, as_of_ms: int | None = None
    ) -> Conversation:
        """`as_of_ms`: a title the model chose for the conversation as read then (a rename
        by the user since is kept)."""
        conversation = await self._owned(user_id, conversation_id)
        renamed = conversation.model_copy(update={"title": title})
        await cql_together(
            self._session,
            [title_row(conversation_id, title, as_of_ms), sidebar_row(user_id, renamed)],
        )
        await self._unless_deleted_meanwhile(user_id, conversation_id, conversation.updated_at)
        return renamed

    async def _unless_deleted_meanwhile(
        self, user_id: str, conversation_id: str, sidebar_at: dt.datetime
    ) -> None:
        """A 404, with what was just written taken away again, where the conversation was
        deleted since it was found: the write brought back a row without an owner (which
        every route, a second delete too, answered 404 for) and a message nothing could
        reach. Read after the write: either the read sees the delete, or the delete comes
        later and removes the write. A read that fails leaves the write as it is."""
        try:
            row = await self._row(conversation_id)
        except CASSANDRA_DOWN:
            return
        if row is not None and row.user_id == user_id:
            return
        erased = conversation_erased(user_id, conversation_id, [sidebar_at])
        await cql_together(self._session, erased)
        raise not_found("conversation")

    async def delete(self, user_id: str, conversation_id: str) -> None:
        """Its messages, every sidebar row (the left-behind ones too) and the conversation,
        in one batch: a delete cut short by a dying gateway left messages that no retry
        could reach (the conversation, gone first, answered 404). Its sidebar rows are
        no older than the conversation: only that part of the user's partition is read
        (reading all of it, each failed API call read every call's conversation)."""
        conversation = await self._owned(user_id, conversation_id)
        since = min(conversation.created_at, conversation.updated_at) - CLOCK_SKEW
        pages = cql_pages(
            self._session,
            "SELECT updated_at, conversation_id FROM conversations_by_user WHERE user_id = %s "
            "AND updated_at >= %s",
            (user_id, since),
        )
        # A page at a time: since an old chat, a busy API user has many calls' rows.
        kept = [
            r.updated_at
            async for page in pages
            for r in page
            if r.conversation_id == conversation_id
        ]
        await cql_together(self._session, conversation_erased(user_id, conversation_id, kept))

    async def has_message(
        self, conversation_id: str, created_at: dt.datetime, message_id: str
    ) -> bool:
        """Whether the message is stored (a row with only a replace mark is not)."""
        rows = await cql(
            self._session,
            "SELECT role FROM messages_by_conversation WHERE conversation_id = %s "
            "AND created_at = %s AND message_id = %s",
            (conversation_id, created_at, message_id),
        )
        return bool(rows) and rows[0].role is not None

    async def first_questions(self, conversation_id: str) -> tuple[str | None, str | None]:
        """The conversation's first message (the user's, as redacted), whose opening
        words titled it, and its first one still in it: not edited away, not failed."""
        rows = await cql(
            self._session,
            "SELECT role, content, status FROM messages_by_conversation "
            "WHERE conversation_id = %s LIMIT 20",  # edits of the first one, their replies
            (conversation_id,),
        )
        asked = [r for r in rows if r.role == "user"]  # a replace mark alone has no role
        live = (r.content for r in asked if r.status not in ("replaced", "failed"))
        return (asked[0].content if asked else None), next(live, None)

    async def owned(self, user_id: str, conversation_id: str) -> Conversation:
        return await self._owned(user_id, conversation_id)

    async def add_user_message(
        self,
        user_id: str,
        conversation: Conversation,
        message_id: str,
        content: str,
        at_ms: int,
        names_it: int | None = None,
    ) -> None:
        """Store the user's message and move the conversation to the top of the sidebar
        (this is on the path to the first token); `names_it`: the conversation's title
        (its first message's, as redacted) is stored with it, as of that time (ms)."""
        at = from_ms(at_ms)
        rows = moved_to_top(user_id, conversation, at)
        if names_it is not None:  # as of the read: a rename since is kept
            rows.append(title_row(conversation.id, conversation.title, names_it))
        await self._with_message(conversation, at, message_id, content, rows)
        await self._unless_deleted_meanwhile(user_id, conversation.id, at)

    async def create_with_message(
        self, user_id: str, conversation: Conversation, message_id: str, content: str
    ) -> None:
        """A new conversation with its first message: an API call's (on the path to the
        first token). The conversation's times are the message's, so its sidebar row is
        already the one at the top."""
        rows = [conversation_row(user_id, conversation), sidebar_row(user_id, conversation)]
        await self._with_message(conversation, conversation.created_at, message_id, content, rows)

    async def _with_message(
        self,
        conversation: Conversation,
        at: dt.datetime,
        message_id: str,
        content: str,
        rows: list[Row],
    ) -> None:
        """A user's message and the rows that show it: all or none, in one round trip,
        where the message fits in a batch; a longer one first, on its own (until the rows
        follow, its conversation does not exist yet or is not yet at the top)."""
        message = user_message_row(conversation, at, message_id, content)
        # A timeout is no proof it failed: Cassandra keeps a logged batch and applies it
        # later, and a lone insert may be applied too. Told "nothing was changed", the
        # client found its message "sent", in the next turn's context, and twice after
        # its retry.
        failed = user_message_row(conversation, at, message_id, content, "failed")
        if len(content.encode()) <= BATCHED_MESSAGE_BYTES:  # nearly every message
            try:
                await cql_together(self._session, [message, *rows])
            except BaseException as exc:
                await self._kept_as_failed(exc, cql(self._session, *failed))
            return
        try:
            await cql(self._session, *message)
        except BaseException as exc:
            await self._kept_as_failed(exc, cql(self._session, *failed))
        try:
            await cql_together(self._session, rows)
        except BaseException as exc:
            # Stored, while the client is told it was not: shown as failed, or it stayed
            # "sent", went into the next turn's context, and the client's retry sent it
            # twice. (Where Cassandra refuses this too, its conversation is not shown.)
            await self._kept_as_failed(exc, self._mark_failed_at(conversation.id, message_id, at))

    @staticmethod
    async def _kept_as_failed(error: BaseException, marking: Awaitable[object]) -> NoReturn:
        """Raise `error`, once the message it left unconfirmed is marked failed; where
        Cassandra did not answer and the mark was made, the client is told so rather
        than "nothing was changed"."""
        try:
            await marking
        except CASSANDRA_DOWN:
            raise error from None
        if not isinstance(error, CASSANDRA_DOWN):
            raise error
        raise ApiError(
            503,
            f"Cassandra did not confirm your message ({type(error).__name__}); it is saved "
            f"as failed: send it again in {UNREACHABLE_RETRY_S} s",
            kind="service_unavailable",
            headers={"Retry-After": str(UNREACHABLE_RETRY_S)},
        ) from error

    async def mark_failed(self, conversation_id: str, message_id: str, at_ms: int) -> None:
        await self._mark_failed_at(conversation_id, message_id, from_ms(at_ms))

    async def _mark_failed_at(self, conversation_id: str, message_id: str, at: dt.datetime) -> None:
        await cql(
            self._session,
            "UPDATE messages_by_conversation SET status = 'failed' WHERE conversation_id = %s "
            "AND created_at = %s AND message_id = %s",
            (conversation_id, at, message_id),
        )

    async def mark_replaced(self, conversation_id: str, keys: Sequence[MessageKey]) -> None:
        """Hide messages superseded by a regenerate or an edit (kept, not deleted)."""
        await mark_replaced(self._session, conversation_id, keys, time.time_ns() // 1000)

    async def _owned(self, user_id: str, conversation_id: str) -> Conversation:
        return conversation_of(conversation_id, await self._owned_row(user_id, conversation_id))

    async def _owned_row(self, user_id: str, conversation_id: str) -> Any:
        """The conversation's row if `user_id` owns it; a 404 otherwise, never a 403 (an
        outsider must not learn that the id exists)."""
        row = await self._row(conversation_id)
        if row is None or row.user_id != user_id:
            raise not_found("conversation")
        return row

    async def _row(self, conversation_id: str) -> Any | None:
        rows = await cql(
            self._session,
            "SELECT user_id, model, title, created_at, updated_at, summary, summary_until, "
            "WRITETIME(summary_until) AS summary_written FROM conversations "
            "WHERE conversation_id = %s",
            (conversation_id,),
        )
        return rows[0] if rows else None


def summary_stale_by_times(conversation: Any, messages: list[Any]) -> bool:
    """A turn the summary covers was replaced after its job may have read it: at most
    SUMMARY_WRITTEN_WITHIN_S before the summary was written (by the write times of the
    turn's status and of the summary). Any replaced turn it covered made it stale: a
    reply regenerated long before (never in it) left every later summary unused."""
    until = conversation.summary_until
    if until is None or conversation.summary_written is None:
        return False
    read_after_us = conversation.summary_written - int(SUMMARY_WRITTEN_WITHIN_S * 1_000_000)
    return any(
        m.status == "replaced"
        and utc(m.created_at) <= utc(until)
        and (m.status_written or 0) > read_after_us
        for m in messages
    )
