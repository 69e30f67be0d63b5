"""Writing finished replies into Cassandra so that every write is idempotent.

An assistant message is keyed by its request id and clustered just after its
prompt's creation time, which every attempt shares. Its writes carry the Cassandra
timestamp `prompt time (µs) + 100 µs x attempt + a rank and a digest of the final (under
100 µs)`: a replayed event rewrites the same cells with the same timestamp (a no-op), the
highest attempt wins whatever order attempts arrive in, and of two different finals of
one attempt the one that keeps more of the reply wins whole (of two that keep as much,
their cells mix 1 time in 25). Anything written for the message before a reply exists
(a placeholder) uses attempt 0, so every reply overrides it.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from schemas.batch import final_output
from schemas.events import SERVICE_JOBS, FinalEvent, MessageKey
from tandoor.clients import cql, cql_together

MESSAGE_STATUS = {
    "stop": "complete",
    "length": "complete",
    "cancelled": "stopped",
    "expired": "expired",
    "error": "failed",
}

ATTEMPT_US = 100  # a reply's write time moves on this much per attempt

INSERT_MESSAGE = """
INSERT INTO messages_by_conversation (conversation_id, created_at, message_id, role, content,
    status, model, attempt, finish_reason, error, prompt_tokens, completion_tokens)
VALUES (?, ?, ?, 'assistant', ?, ?, ?, ?, ?, ?, ?, ?) USING TIMESTAMP ?
"""
INSERT_USAGE = """
INSERT INTO usage_by_user_day (user_id, day, model, request_id, tier, prompt_tokens,
    completion_tokens, finish_reason, finished_at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) USING TIMESTAMP ?
"""
INSERT_BATCH_OUTPUT = """
INSERT INTO batch_outputs (user_id, batch_id, custom_id, status_code, output, answered_at)
VALUES (?, ?, ?, ?, ?, ?) USING TIMESTAMP ?
"""
TOUCH_CONVERSATION = (
    "UPDATE conversations USING TIMESTAMP ? SET last_reply_at = ? WHERE conversation_id = ?"
)
MARK_REPLACED = (
    "UPDATE messages_by_conversation USING TIMESTAMP %s SET status = 'replaced' "
    "WHERE conversation_id = %s AND created_at = %s AND message_id = %s"
)
REPLACED_PER_BATCH = 200  # status updates of about 100 bytes each: under the 50 KiB warning


async def mark_replaced(
    session: Any, conversation_id: str, keys: Sequence[MessageKey], timestamp_us: int
) -> None:
    """Hide messages superseded by a regenerate or an edit (kept, not deleted), in
    batches on their one partition, all of a batch or none. The timestamp is the new
    reply's write time: later than any write of what it replaces, even one stored after
    the mark (a reply still on its way through persistence)."""
    for start in range(0, len(keys), REPLACED_PER_BATCH):
        await cql_together(
            session,
            [
                (
                    MARK_REPLACED,
                    (timestamp_us, conversation_id, _utc(k.created_at_ms), k.message_id),
                )
                for k in keys[start : start + REPLACED_PER_BATCH]
            ],
        )


def batch_output_row(
    user_id: str, batch_id: str, output: dict[str, Any], written_us: int, answered_at_ms: int
) -> tuple[Any, ...]:
    """INSERT_BATCH_OUTPUT's values for one output line of a batch: when it was answered
    (the batch's completed_at is the latest), and the write time that decides between
    two answers (a replay of the same answer passes the same, so it does not move)."""
    response = output.get("response") or {}
    status = response.get("status_code")
    custom_id = output["custom_id"]
    answered_at = _utc(answered_at_ms)
    return (
        user_id,
        batch_id,
        custom_id,
        status,
        orjson.dumps(output).decode(),
        answered_at,
        written_us,
    )


def reply_slot_ms(prompt_created_at_ms: int) -> int:
    """When a reply sits in the conversation: right after its prompt, in every attempt."""
    return prompt_created_at_ms + 1


def reply_time_ms(final: FinalEvent) -> int:
    return reply_slot_ms(final.prompt_created_at_ms or final.created_at_ms)


def write_timestamp_us(final: FinalEvent) -> int:
    """Later attempts win. Two runs of one attempt (leased by nobody while Redis was
    down) are ranked by what the user keeps, a whole reply over a partial one over an
    empty one, then told apart by a digest: with one timestamp, Cassandra merged their
    cells (one's text, the other's token counts); by the digest alone, an empty
    "expired" rerun past the deadline erased a finished reply 1 time in 4."""
    digest = zlib.crc32(f"{final.finish_reason}\0{final.text}".encode()) % DIGEST_SPAN
    within = _kept_rank(final) * DIGEST_SPAN + digest
    return reply_time_ms(final) * 1000 + final.attempt * ATTEMPT_US + within


DIGEST_SPAN = ATTEMPT_US // 4  # four ranks in an attempt's span


def batch_output_written_us(attempt: int, rank: int, answer: str) -> int:
    """A batch line's output write time: its rank alone (a later attempt, then what the
    user keeps, then a digest), never a time. By the answer's time, a rerun of the line
    (its marks lost with Redis, forwarded anew with a later prompt time, or answered
    "expired" by a worker or by admission past its window) replaced the 200 it had.
    Admission's answers to lines it never ran are attempt 0: any run's answer wins."""
    return attempt * ATTEMPT_US + rank * DIGEST_SPAN + zlib.crc32(answer.encode()) % DIGEST_SPAN


def _kept_rank(final: FinalEvent) -> int:
    if final.finish_reason in ("stop", "length"):
        return 3
    if final.text:
        return 2  # stopped or failed part way: what was said is kept
    return 1 if final.finish_reason == "error" else 0  # an error at least says why


class HistoryWriter:
    """Prepared statements for storing final events; one instance per session."""

    def __init__(self, session: Any, redact: Callable[[str], str] = str) -> None:
        self._session = session
        self._redact = redact  # the output moderation the client saw while streaming
        self._message = session.prepare(INSERT_MESSAGE)
        self._usage = session.prepare(INSERT_USAGE)
        self._touch = session.prepare(TOUCH_CONVERSATION)
        self._batch_output = session.prepare(INSERT_BATCH_OUTPUT)

    async def store(self, final: FinalEvent) -> None:
        writes = [self._store_usage(final)]
        if final.kind == "chat" and final.store and final.conversation_id:
            writes += [self._store_message(final), self._touch_conversation(final)]
            if final.replaces:  # the gateway's own marks, again: it may have died first
                stamp = write_timestamp_us(final)
                writes.append(
                    mark_replaced(self._session, final.conversation_id, final.replaces, stamp)
                )
        if final.custom_id is not None and final.batch_id:
            writes.append(self._store_batch_output(final, final.batch_id))
        await asyncio.gather(*writes)

    async def _store_batch_output(self, final: FinalEvent, batch_id: str) -> None:
        output = final_output(final, self._redact(final.text))
        answer = f"{final.finish_reason}\0{final.text}"
        written_us = batch_output_written_us(final.attempt, _kept_rank(final), answer)
        row = batch_output_row(final.user_id, batch_id, output, written_us, final.created_at_ms)
        await cql(self._session, self._batch_output, row)

    async def _store_message(self, final: FinalEvent) -> None:
        usage = final.usage
        await cql(
            self._session,
            self._message,
            (
                final.conversation_id,
                _utc(reply_time_ms(final)),
                final.request_id,
                self._redact(final.text),
                MESSAGE_STATUS[final.finish_reason],
                final.model,
                final.attempt,
                final.finish_reason,
                final.error,
                usage.prompt_tokens,
                usage.completion_tokens,
                write_timestamp_us(final),
            ),
        )

    async def _store_usage(self, final: FinalEvent) -> None:
        if not final.user_id or final.kind in SERVICE_JOBS:
            # A malformed prompt's error event: nobody to charge. A title or summary:
            # the service's own (charged no quota), counted on the usage stream only.
            return
        day = _utc(reply_time_ms(final)).date()  # the prompt's day, stable across attempts
        await cql(
            self._session,
            self._usage,
            (
                final.user_id,
                day,
                final.model,
                final.request_id,
                final.tier,
                final.usage.prompt_tokens,
                final.usage.completion_tokens,
                final.finish_reason,
                _utc(final.created_at_ms),
                write_timestamp_us(final),
            ),
        )

    async def _touch_conversation(self, final: FinalEvent) -> None:
        # Written at the prompt's time, as the message is (one reply runs at a time, so
        # the newest prompt's reply dates the chat): at the finish time it outdated a
        # delete made meanwhile, and the row came back holding only last_reply_at.
        stamp = write_timestamp_us(final)
        await cql(
            self._session, self._touch, (stamp, _utc(final.created_at_ms), final.conversation_id)
        )


def _utc(ms: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC)
