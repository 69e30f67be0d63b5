"""`tandoor persist` against real Kafka and Cassandra: replies stored once, in place,
whatever the replays, attempts and crashes."""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer

from consumers.history import HistoryWriter, reply_time_ms
from producers.admission.answers import Answers
from producers.gateway.conversations.service import ConversationService
from producers.gateway.errors import ApiError
from schemas.batch import expired_output
from schemas.events import MessageKey, now_ms
from tandoor.clients import cassandra_session
from tandoor.settings import Settings
from tests.integration.persisting import (
    StartPersist,
    final,
    publish,
    select_rows,
    settled_rows,
    wait_rows,
)
from tests.waiting import eventually

pytestmark = pytest.mark.integration


async def test_replies_are_stored_once_with_their_status_and_usage(
    settings: Settings, keyspace: str, producer: AIOKafkaProducer, start_persist: StartPersist
) -> None:
    conversation = f"c-{uuid.uuid4().hex[:8]}"
    done = final(conversation, "The capital of France is Paris.")
    stopped = final(conversation, "Once upon a", reason="cancelled")
    private = final(conversation, "Write to ada@example.com or call +44 20 7946 0958.")
    title = final(conversation, "Paris facts", kind="title")  # the service's own job
    process = await start_persist()
    await publish(producer, title, done, stopped, private, done)  # replaying `done`: no change
    rows = await settled_rows(settings, keyspace, producer, conversation, 3)
    assert process.terminate() == 0  # SIGTERM: a clean exit
    by_id = {row.message_id: row for row in rows}
    assert len(rows) == 3
    # Stored as it streamed: through the output moderation.
    assert by_id[private.request_id].content == "Write to [email] or call [phone]."
    assert (by_id[done.request_id].content, by_id[done.request_id].status) == (
        done.text,
        "complete",
    )
    assert (by_id[stopped.request_id].content, by_id[stopped.request_id].status) == (
        "Once upon a",
        "stopped",
    )
    # Right after its prompt, so it sorts after the user message stored at prompt time.
    assert done.prompt_created_at_ms is not None
    epoch = dt.datetime(1970, 1, 1)
    expected = epoch + dt.timedelta(milliseconds=done.prompt_created_at_ms + 1)
    assert by_id[done.request_id].created_at == expected
    with cassandra_session(settings, keyspace) as session:
        usage = list(
            session.execute(
                "SELECT request_id, prompt_tokens, completion_tokens FROM usage_by_user_day "
                "WHERE user_id = 'alice' AND day = %s",
                (by_id[done.request_id].created_at.date(),),
            )
        )
        touched = session.execute(
            "SELECT last_reply_at FROM conversations WHERE conversation_id = %s", (conversation,)
        ).one()
    assert {(u.request_id, u.completion_tokens) for u in usage} >= {
        (done.request_id, 6),
        (stopped.request_id, 3),
    }
    # A title or summary the service asked for is not the user's: "Your usage" showed
    # two requests for one message (and never matched the quota's count).
    assert title.request_id not in {u.request_id for u in usage}
    assert touched is not None and touched.last_reply_at is not None


async def test_the_highest_attempt_wins_in_any_order(
    settings: Settings, keyspace: str, producer: AIOKafkaProducer, start_persist: StartPersist
) -> None:
    conversation = f"c-{uuid.uuid4().hex[:8]}"
    prompt_at = now_ms() - 5000
    second = final(conversation, "second attempt", attempt=2, request_id="r-x", prompt_at=prompt_at)
    late_first = final(
        conversation, "first attempt", attempt=1, request_id="r-x", prompt_at=prompt_at
    )
    await start_persist()
    await publish(producer, second, late_first)
    rows = await settled_rows(settings, keyspace, producer, conversation, 1)
    assert [(r.message_id, r.content, r.attempt) for r in rows] == [("r-x", "second attempt", 2)]


async def test_two_different_finals_of_one_attempt_are_never_stored_mixed(
    settings: Settings, keyspace: str, producer: AIOKafkaProducer, start_persist: StartPersist
) -> None:
    """Redis down through a rebalance: two workers ran one request as attempt 1 without
    leases. Written with one timestamp, Cassandra kept the greater value of each cell:
    one final's text with the other's token count and finish reason."""
    conversation = f"c-{uuid.uuid4().hex[:8]}"
    prompt_at = now_ms() - 5000
    one = final(conversation, "zz", request_id="r-y", prompt_at=prompt_at)  # 1 token
    other = final(
        conversation, "aa bb cc", request_id="r-y", prompt_at=prompt_at, reason="cancelled"
    )
    await start_persist()
    await publish(producer, one, other)
    rows = await settled_rows(settings, keyspace, producer, conversation, 1)
    stored = [(r.content, r.completion_tokens, r.finish_reason) for r in rows]
    assert stored in ([("zz", 1, "stop")], [("aa bb cc", 3, "cancelled")]), stored


async def test_kill_9_and_restart_loses_and_duplicates_nothing(
    settings: Settings, keyspace: str, producer: AIOKafkaProducer, start_persist: StartPersist
) -> None:
    conversation = f"c-{uuid.uuid4().hex[:8]}"
    replies = [final(conversation, f"reply number {i}") for i in range(120)]
    process = await start_persist()
    await publish(producer, *replies[:60])
    await wait_rows(settings, keyspace, conversation, 20)
    process.kill()  # mid-stream: some stored, maybe some stored but not committed
    await publish(producer, *replies[60:])
    await start_persist()
    rows = await settled_rows(settings, keyspace, producer, conversation, 120)
    assert sorted(r.message_id for r in rows) == sorted(r.request_id for r in replies)
    assert {r.message_id: r.content for r in rows} == {r.request_id: r.text for r in replies}


async def test_a_reply_finished_after_its_conversation_was_deleted_is_not_kept(
    session: Any,
) -> None:
    """Deleted while the reply still runs: the reply's writes carry its prompt's time,
    older than the delete, so Cassandra keeps them shadowed and nothing of the chat
    comes back (opening it is a 404, its partition holds no row)."""
    conversations = ConversationService(session, ["smollm2"])
    opened = await conversations.create("alice", "smollm2", "t")
    prompt_at = now_ms() - 1000
    request_id = f"req-{uuid.uuid4().hex[:10]}"
    await conversations.add_user_message("alice", opened, request_id, "hi", prompt_at)
    await conversations.delete("alice", opened.id)

    reply = final(opened.id, "the reply", request_id=request_id, prompt_at=prompt_at)
    await HistoryWriter(session).store(reply)

    stored = session.execute(
        "SELECT message_id FROM messages_by_conversation WHERE conversation_id = %s",
        (opened.id,),
    )
    assert list(stored) == []
    row = session.execute("SELECT * FROM conversations WHERE conversation_id = %s", (opened.id,))
    assert list(row) == [], "the row came back, holding only last_reply_at"
    with pytest.raises(ApiError) as gone:
        await conversations.get("alice", opened.id)
    assert gone.value.status == 404


async def test_a_final_hides_what_its_prompt_replaced_even_what_is_stored_after_it(
    settings: Settings, keyspace: str, producer: AIOKafkaProducer, start_persist: StartPersist
) -> None:
    """A regenerate whose gateway died right after queueing it never marked the old
    replies replaced (both were shown). The new reply's final carries what it replaces,
    and persistence hides those as it stores it: one stored before it, and one whose own
    final comes after (a reply still on its way), which stays hidden."""
    conversation = f"c-{uuid.uuid4().hex[:8]}"
    stored = final(conversation, "the first answer", prompt_at=now_ms() - 9000)
    late = final(conversation, "an answer on its way", prompt_at=now_ms() - 6000)
    keys = [
        MessageKey(created_at_ms=reply_time_ms(old), message_id=old.request_id)
        for old in (stored, late)
    ]
    new = final(conversation, "the regenerated answer").model_copy(update={"replaces": keys})
    await start_persist()
    await publish(producer, stored)
    await wait_rows(settings, keyspace, conversation, 1)
    await publish(producer, new, late)
    rows = await settled_rows(settings, keyspace, producer, conversation, 3)
    assert {r.message_id: (r.content, r.status) for r in rows} == {
        stored.request_id: ("the first answer", "replaced"),
        late.request_id: ("an answer on its way", "replaced"),
        new.request_id: ("the regenerated answer", "complete"),
    }


async def test_a_replayed_batch_answer_keeps_its_write_time(
    settings: Settings, keyspace: str, producer: AIOKafkaProducer, start_persist: StartPersist
) -> None:
    """A batch's completed_at is its last answer's write time: a final read again (a
    persistence consumer restarted before its commit) must not move it."""
    conversation = f"c-{uuid.uuid4().hex[:8]}"
    batch_id = f"batch-{uuid.uuid4().hex[:8]}"
    answer = final(conversation, "42").model_copy(
        update={"kind": "batch", "batch_id": batch_id, "custom_id": "line-1"}
    )
    await start_persist()

    def written() -> list[Any]:
        return batch_output_rows(settings, keyspace, batch_id)

    await publish(producer, answer)
    first = await eventually(lambda: asyncio.to_thread(written), bool, what="the answer stored")
    await publish(producer, answer)  # the replay: through Kafka, so later by milliseconds
    await settled_rows(settings, keyspace, producer, f"{conversation}-flush", 0)
    assert await asyncio.to_thread(written) == first
    assert first[0].answered_at == dt.datetime.fromtimestamp(
        answer.created_at_ms / 1000, dt.UTC
    ).replace(tzinfo=None)


def batch_output_rows(settings: Settings, keyspace: str, batch_id: str) -> list[Any]:
    query = (
        "SELECT status_code, output, answered_at, WRITETIME(output) AS at FROM batch_outputs "
        "WHERE user_id = 'alice' AND batch_id = %s"
    )
    return select_rows(settings, keyspace, query, (batch_id,))


async def test_an_empty_rerun_of_a_batch_line_keeps_the_answer_it_had(
    settings: Settings,
    keyspace: str,
    session: Any,
    producer: AIOKafkaProducer,
    start_persist: StartPersist,
) -> None:
    """Redis restarted empty (the line's marks and charge gone) and admission read the
    line again: forwarded anew (a later prompt time) it ran again as attempt 1 and was
    answered "expired" and empty, or admission answered it "expired" itself past its
    window. Written at its own later time, either replaced the answer the line had, and
    a 200 moved to the batch's error file."""
    conversation, batch_id = f"c-{uuid.uuid4().hex[:8]}", f"batch-{uuid.uuid4().hex[:8]}"
    line = {"kind": "batch", "batch_id": batch_id, "custom_id": "line-1"}
    prompt_at = now_ms() - 5000
    answer = final(conversation, "42", request_id="r-b", prompt_at=prompt_at)
    answer = answer.model_copy(update=line)
    rerun = final(conversation, "", reason="expired", request_id="r-b", prompt_at=prompt_at + 3000)
    rerun = rerun.model_copy(update={**line, "created_at_ms": answer.created_at_ms + 60_000})
    await start_persist()
    await publish(producer, answer, rerun)
    await settled_rows(settings, keyspace, producer, f"{conversation}-flush", 0)
    await Answers(producer, session).send("alice", batch_id, expired_output("line-1", "r-b"))
    (stored,) = await asyncio.to_thread(batch_output_rows, settings, keyspace, batch_id)
    assert stored.status_code == 200 and "42" in stored.output
    answered_at = dt.datetime.fromtimestamp(answer.created_at_ms / 1000, dt.UTC)
    assert stored.answered_at == answered_at.replace(tzinfo=None)


async def test_the_first_question_of_a_chat_is_the_one_its_edit_left(session: Any) -> None:
    """A chat's title job asked the model with its first message as first sent, edited
    away since, beside the edit: the title named text the user had taken back."""
    conversations = ConversationService(session, ["smollm2"])
    opened = await conversations.create("alice", "smollm2", "Where is Paris?")
    asked_at = now_ms() - 2000
    await conversations.add_user_message("alice", opened, "m_first", "Where is Paris?", asked_at)
    assert await conversations.first_questions(opened.id) == ("Where is Paris?",) * 2
    await conversations.add_user_message("alice", opened, "m_edit", "Where is Rome?", asked_at + 1)
    await conversations.mark_replaced(
        opened.id, [MessageKey(created_at_ms=asked_at, message_id="m_first")]
    )
    assert await conversations.first_questions(opened.id) == ("Where is Paris?", "Where is Rome?")
