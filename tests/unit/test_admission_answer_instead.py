"""Admission answering a waiting line instead of running it (its batch cancelled, its
window over, its key revoked) while a store fails, with stand-ins for the stores (the
real ones: tests/integration/test_batch_admission.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from functools import partial
from typing import Any, cast
from unittest.mock import patch

import pytest
from aiokafka.errors import KafkaConnectionError
from cassandra.cluster import NoHostAvailable

from producers.admission.role import Admission
from producers.admission.waiting import Waiting
from schemas.events import PromptRequest
from tandoor.settings import Settings
from tests.unit.test_admission_forward import AdmitsAll, ByBatch, Counting, Valid, batch_prompt
from tests.waiting import until


class CancelledBatches(ByBatch):
    def __init__(self, *cancelled: str) -> None:
        self.batches = set(cancelled)

    async def cancelled(self, owner: str, batch_id: str | None) -> bool:
        return batch_id in self.batches

    async def mark(self, request_id: str, position: str, first_only: bool = False) -> None:
        return None


class CassandraDown:
    async def unrun(self, prompt: Any, why: str) -> None:
        raise NoHostAvailable("Cassandra is unreachable", {})


class RoomyBand:
    def room(self, model: str) -> int:
        return 8

    def sent(self, model: str) -> None:
        pass


@pytest.fixture
async def admission() -> AsyncIterator[Admission]:
    admission = Admission(Settings())
    admission.callers, admission.band = cast(Any, Valid()), cast(Any, RoomyBand())
    yield admission
    await admission.consumer.stop()  # never started: closed for their finalizers
    await admission.producer.stop()


def waiting_line(admission: Admission, user: str, batch: str, offset: int) -> Waiting:
    update = {"request_id": f"bl_{offset}", "user_id": user, "batch_id": batch}
    prompt = batch_prompt(admission).model_copy(update=update)
    admission.queued.add(prompt.request_id, f"0:{offset}")
    admission.queues[prompt.model].push(user, Waiting(0, offset, prompt), 0.0)
    return Waiting(0, offset, prompt)


async def test_a_cancelled_line_cassandra_cannot_answer_holds_up_no_other_line(
    admission: Admission,
) -> None:
    """Its answer (stored in Cassandra first) was retried every second in the forward
    loop itself: no line of anyone's, any model's, went to the band until Cassandra
    came back."""
    submitter = Counting()
    admission.marks = cast(Any, CancelledBatches("A"))
    admission.answers = cast(Any, CassandraDown())
    admission.submitter, admission.quotas = cast(Any, submitter), cast(Any, AdmitsAll())
    waiting_line(admission, "u", "A", 1)  # the lowest counter: its turn comes first
    other = waiting_line(admission, "v", "B", 2)
    admission.queues[other.prompt.model].charge("v", 100)
    forwarding = asyncio.create_task(admission._forward_lines())
    try:
        # Held up, nothing is ever sent: what stalls is what the wait fails on.
        await until(lambda: submitter.sent, what="the other line sent", idle_s=30, poll_s=0.05)
    finally:
        admission._stopping.set()
        await asyncio.wait_for(forwarding, 10)
    assert submitter.sent == [other.prompt.request_id]
    assert admission.queued.where("bl_1") == "0:1", "left waiting for its answer"


class KafkaDownOnce(Counting):
    async def submit(self, prompt: PromptRequest) -> None:
        if not self.sent:
            self.sent.append("refused")
            raise KafkaConnectionError()
        await super().submit(prompt)


@pytest.mark.parametrize("found_by", ["its retry", "the sweep"])
async def test_a_line_charged_then_cancelled_before_it_went_out_is_refunded(
    admission: Admission, found_by: str
) -> None:
    """Charged, Kafka refused it, and its batch was cancelled while it waited for its
    retry: answered cancelled but still charged (a request and its tokens of the minute,
    on every surface), whether its retry or the sweep found it first."""
    marks, quotas, submitter = CancelledBatches(), AdmitsAll(), KafkaDownOnce()
    admission.marks, admission.quotas = cast(Any, marks), cast(Any, quotas)
    admission.submitter, admission.answers = cast(Any, submitter), cast(Any, Sent())
    line = waiting_line(admission, "u", "A", 1)
    queue = admission.queues[line.prompt.model]
    queue.pop(0.0)
    assert not await admission._forward(queue, "u", line)  # refused: put back, still charged
    marks.batches.add("A")  # the user cancels while Kafka is away
    if found_by == "the sweep":
        await admission._answer_unrunnable()
    else:
        again = queue.pop(time.monotonic() + 60)  # its turn again, once its hold is over
        assert again is not None
        assert not await admission._forward(queue, *again)
    assert submitter.sent == ["refused"]
    assert cast(Any, admission.answers).unrun_lines == [line.prompt.request_id]
    assert quotas.refunded == [line.prompt.request_id] and not admission._charged


class Sent:
    def __init__(self) -> None:
        self.unrun_lines: list[str] = []

    async def unrun(self, prompt: PromptRequest, why: str) -> None:
        self.unrun_lines.append(prompt.request_id)


async def test_a_line_too_large_for_kafka_is_charged_once_though_its_answer_waits(
    admission: Admission,
) -> None:
    """Refunded, then its 413 failed (Cassandra down): each retry charged it again, and
    the refund (one per request) undid only the first."""
    from producers.prompts import PromptTooLarge

    class TooLarge(Counting):
        async def submit(self, prompt: PromptRequest) -> None:
            self.sent.append(prompt.request_id)
            raise PromptTooLarge(2_000_000)

    class FailsOnce:
        def __init__(self) -> None:
            self.sent: list[dict[str, Any]] = []

        async def send(self, owner: str | None, batch: str | None, output: dict[str, Any]) -> None:
            self.sent.append(output)
            if len(self.sent) == 1:
                raise NoHostAvailable("Cassandra is unreachable", {})

    marks, quotas, answers = CancelledBatches(), AdmitsAll(), FailsOnce()
    admission.marks, admission.quotas = cast(Any, marks), cast(Any, quotas)
    admission.submitter, admission.answers = cast(Any, TooLarge()), cast(Any, answers)
    line = waiting_line(admission, "u", "A", 1)
    queue = admission.queues[line.prompt.model]
    with patch("producers.admission.line_steps.RETRY_S", 0.01):
        for _ in range(4):
            picked = queue.pop(float("inf"))  # past any hold
            if picked is None:
                break
            await admission._until_done(partial(admission._forward, queue, *picked))
    statuses = [output["response"]["status_code"] for output in answers.sent]
    assert statuses == [413, 413] and quotas.admitted == [line.prompt.request_id]


class Answers:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    async def send(self, owner: str | None, batch: str | None, output: dict[str, Any]) -> None:
        self.sent.append(output)


async def test_a_line_answered_500_for_a_defect_is_counted_apart(admission: Admission) -> None:
    """Counted as "refused", a defect's 500 was one with the users' own 4xx: nothing to
    alert on but a log line."""
    from aiokafka.structs import ConsumerRecord

    from producers.admission.lines import Refused

    admission.marks, admission.answers = cast(Any, CancelledBatches()), cast(Any, Answers())
    for offset, status in ((1, 400), (2, 500)):
        record = ConsumerRecord("batch.requests", 0, offset, 0, 0, None, b"", None, 0, 0, [])
        admission.offsets.taken("batch.requests", 0, offset)
        refused = Refused(status, "no", "api_error" if status == 500 else "invalid_request_error")
        await admission._refuse(record, "A", "u", "q", f"bl_{offset}", refused)
    counted = {
        outcome: admission.metrics.lines.labels(outcome)._value.get()
        for outcome in ("refused", "defect")
    }
    assert counted == {"refused": 1, "defect": 1}
    statuses = [o["response"]["status_code"] for o in cast(Any, admission.answers).sent]
    assert statuses == [400, 500]
