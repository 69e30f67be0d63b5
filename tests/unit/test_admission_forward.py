"""Admission forwarding a waiting line, with stand-ins for its stores and producers:
marks that fail, stores down, cancelled batches, topics refusing writes (keys:
test_admission_keys.py; the real ones: tests/integration/test_batch_admission.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import replace
from functools import partial
from typing import Any, cast
from unittest.mock import patch

import pytest
from aiokafka.errors import KafkaTimeoutError
from cassandra.cluster import NoHostAvailable
from redis.exceptions import ConnectionError as RedisConnectionError

from producers.admission.role import Admission
from producers.admission.waiting import Waiting
from schemas.events import PromptRequest
from tandoor.policies.quota import charged
from tandoor.settings import Settings


def batch_prompt(admission: Admission) -> PromptRequest:
    return PromptRequest.model_validate(
        {
            "request_id": "bl_1",
            "model": admission.settings.served_models[0],
            "user_id": "u",
            "tier": "batch",
            "band": "batch",
            "conversation_id": "bl_1",
            "messages": [{"role": "user", "content": "Hi"}],
            "sampling": {"max_tokens": 4},
            "created_at_ms": 1,
            "batch_id": "b1",
            "custom_id": "line-0",
        }
    )


class ByBatch:
    taken: frozenset[str] = frozenset()  # request ids a worker took (a lease, a done mark)

    async def cancelled(self, owner: str, batch_id: str | None) -> bool:
        raise NotImplementedError

    async def run_by_a_worker(self, request_id: str) -> bool:
        return request_id in self.taken

    async def cancelled_batches(
        self, batches: Iterable[tuple[str, str | None]]
    ) -> set[tuple[str, str | None]]:
        return {batch for batch in set(batches) if await self.cancelled(*batch)}


class StandInMarks(ByBatch):
    async def cancelled(self, owner: str, batch_id: str | None) -> bool:
        return True

    async def mark(self, request_id: str, position: str, first_only: bool = False) -> None:
        return None


class CassandraDown:
    async def unrun(self, prompt: Any, why: str) -> None:
        raise NoHostAvailable("Cassandra is unreachable", {})


async def test_a_store_down_ends_the_sweep_of_cancelled_lines_not_the_forwarding() -> None:
    """The sweep answering a cancelled batch's waiting lines retried each one until the
    store answered: forwarding, every model's, stopped meanwhile (it needs Redis and
    Kafka only)."""
    admission = Admission(Settings())
    prompt = batch_prompt(admission)
    admission.marks = cast(Any, StandInMarks())
    admission.answers = cast(Any, CassandraDown())
    admission.queued.add(prompt.request_id, "0:3")
    admission.queues[prompt.model].push("u", Waiting(0, 3, prompt), 0.0)
    try:
        await asyncio.wait_for(admission._answer_unrunnable(), 5)
    finally:
        await admission.consumer.stop()  # never started: closed for their finalizers
        await admission.producer.stop()
    assert admission.queues[prompt.model].size == 1, "left for the next sweep"


class MarkFailsOnce:
    def __init__(self) -> None:
        self.marked: list[str] = []

    async def mark(self, request_id: str, position: str, first_only: bool = False) -> None:
        if not self.marked:
            self.marked.append("failed")
            raise RedisConnectionError("Redis is unreachable")
        self.marked.append(position)

    async def run_by_a_worker(self, request_id: str) -> bool:
        return False


class Counting:
    def __init__(self) -> None:
        self.sent: list[str] = []
        self.prompts: list[PromptRequest] = []

    async def submit(self, prompt: PromptRequest) -> None:
        self.sent.append(prompt.request_id)
        self.prompts.append(prompt)


class AdmitsAll:
    def __init__(self) -> None:
        self.admitted: list[str] = []
        self.accounts: list[str] = []
        self.refunded: list[str] = []

    async def admit(self, account: str, policy: Any, request_id: str, *_: Any, **__: Any) -> Any:
        self.admitted.append(request_id)
        self.accounts.append(account)
        return charged(account, request_id, 1, 0)

    async def refund(self, admission: Any) -> None:
        self.refunded.append(admission.request_id)


async def test_a_mark_that_fails_after_the_forward_does_not_forward_the_line_again() -> None:
    """The whole step was tried again: the line went to the model's topic twice (and,
    with Redis failing, no worker could tell the copies apart)."""
    admission = Admission(Settings())
    prompt = batch_prompt(admission)
    marks, submitter = MarkFailsOnce(), Counting()
    admission.marks, admission.submitter = cast(Any, marks), cast(Any, submitter)
    admission.quotas, admission.callers = cast(Any, AdmitsAll()), cast(Any, Valid())
    admission._why_unrun = lambda waiting: _none()  # type: ignore[method-assign]
    admission.queued.add(prompt.request_id, "0:3")
    queue = admission.queues[prompt.model]
    try:
        with patch("producers.admission.line_steps.RETRY_S", 0.01):
            forward = partial(admission._forward, queue, "u", Waiting(0, 3, prompt))
            assert await admission._until_done(forward)
    finally:
        await admission.consumer.stop()  # never started: closed for their finalizers
        await admission.producer.stop()
    assert submitter.sent == [prompt.request_id], "forwarded more than once"
    assert marks.marked == ["failed", "0:3"], "the mark was not written in the end"


async def _none() -> None:
    return None


class Valid:
    async def resolve(self, key: str | None) -> object:
        return object()

    resolve_again = resolve


class Answers:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    async def send(self, owner: str | None, batch_id: str | None, output: dict[str, Any]) -> None:
        self.sent.append(output)


async def forward_once(
    callers: object, marks: object | None = None, submitter: Any = None, quotas: Any = None
) -> tuple[Any, Answers, PromptRequest, Admission]:
    """One waiting line's turn to be forwarded, with these keys, marks, submitter and
    quotas."""
    admission = Admission(Settings())
    prompt = batch_prompt(admission).model_copy(update={"charged_tokens": 40})
    submitter, answers = submitter or Counting(), Answers()
    admission.marks = cast(Any, marks or StandInMarks())
    admission.submitter, admission.answers = cast(Any, submitter), cast(Any, answers)
    admission.quotas, admission.callers = cast(Any, quotas or AdmitsAll()), cast(Any, callers)
    admission._why_unrun = lambda waiting: _none()  # type: ignore[method-assign]
    admission.queued.add(prompt.request_id, "0:3")
    try:
        with patch("producers.admission.line_steps.RETRY_S", 0.01):
            forward = partial(
                admission._forward,
                admission.queues[prompt.model],
                "u",
                Waiting(0, 3, prompt, "tdr_key"),
            )
            await admission._until_done(forward)
    finally:
        await admission.consumer.stop()  # never started: closed for their finalizers
        await admission.producer.stop()
    return submitter, answers, prompt, admission


class CancelledBatchA(ByBatch):
    async def cancelled(self, owner: str, batch_id: str | None) -> bool:
        return batch_id == "A"

    async def mark(self, request_id: str, position: str, first_only: bool = False) -> None:
        return None


class Recorded:
    """What went out, in order: answers (without running) and forwards."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.b_forwarded = asyncio.Event()

    async def unrun(self, prompt: PromptRequest, why: str) -> None:
        self.events.append(("answered", prompt.user_id))

    async def submit(self, prompt: PromptRequest) -> None:
        self.events.append(("forwarded", prompt.user_id))
        if prompt.user_id == "b":
            self.b_forwarded.set()


class Room:
    def room(self, model: str) -> int:
        return 8

    def sent(self, model: str) -> None:
        return None


async def test_a_cancelled_batch_answered_line_by_line_does_not_hold_up_other_tenants() -> None:
    """Answered lines were not counted as served: the tenant kept the lowest counter and
    every turn, and B got nothing until all of A's 2,000 lines had been answered."""
    admission = Admission(Settings())
    recorded = Recorded()
    admission.marks, admission.answers = cast(Any, CancelledBatchA()), cast(Any, recorded)
    admission.submitter, admission.band = cast(Any, recorded), cast(Any, Room())
    admission.quotas, admission.callers = cast(Any, AdmitsAll()), cast(Any, Valid())
    model = admission.settings.served_models[0]
    for i in range(2000):
        for user, batch in (("a", "A"), ("b", "B")):
            if user == "b" and i >= 20:
                continue
            prompt = batch_prompt(admission).model_copy(
                update={
                    "request_id": f"bl_{user}{i}",
                    "user_id": user,
                    "batch_id": batch,
                    "charged_tokens": 10,
                }
            )
            admission.queued.add(prompt.request_id, f"0:{2 * i + (user == 'b')}")
            admission.queues[model].push(user, Waiting(0, 2 * i + (user == "b"), prompt), 0.0)
    forwarding = asyncio.create_task(admission._forward_lines())
    try:
        await recorded.b_forwarded.wait()
    finally:
        admission.request_stop()
        await forwarding
        await admission.consumer.stop()  # never started: closed for their finalizers
        await admission.producer.stop()
    before_b = recorded.events[: recorded.events.index(("forwarded", "b"))]
    assert len(before_b) <= 300, f"{len(before_b)} of A's lines answered before B's first"


class AdmitsUncounted(AdmitsAll):
    """Redis refuses the charge; the tier is served uncounted then."""

    async def admit(self, account: str, policy: Any, request_id: str, *_: Any, **__: Any) -> Any:
        return replace(charged(account, request_id, 40, 0), counted=False)


async def test_a_line_admitted_uncounted_carries_nothing_to_settle() -> None:
    """It carried its estimate: once Redis answered again, the usage stream settled the
    difference against a minute never charged, and the user's count went down."""
    submitter, _, _, _ = await forward_once(Valid(), quotas=AdmitsUncounted())
    (sent,) = submitter.prompts
    assert sent.charged_tokens == 0
    submitter, _, _, _ = await forward_once(Valid())
    assert submitter.prompts[0].charged_tokens == 40  # counted: its estimate, to settle


class NothingCancelled(StandInMarks):
    async def cancelled(self, owner: str, batch_id: str | None) -> bool:
        return False


class OneTopicUnwritable:
    """Kafka refuses one model's topic (no leader for its partitions, too few of them,
    an ACL) and takes the other's."""

    def __init__(self, unwritable: str) -> None:
        self.unwritable = unwritable
        self.tried: list[str] = []
        self.sent: list[str] = []
        self.other_sent = asyncio.Event()

    async def submit(self, prompt: PromptRequest) -> None:
        self.tried.append(prompt.model)
        if prompt.model == self.unwritable:
            raise KafkaTimeoutError()
        self.sent.append(prompt.request_id)
        self.other_sent.set()


async def test_a_model_whose_topic_refuses_writes_holds_up_only_its_own_lines() -> None:
    """Its line was retried every second, for ever, in the one loop that forwards every
    model's lines and sweeps cancelled batches: the other model's lines, and cancels,
    waited as long. Then, its tenants' lines were each tried in one pass (a failed try
    can take Kafka's 40 s request timeout: twenty minutes for 32 lines), until it
    was held back only as the pass began."""
    admission = Admission(Settings())
    first, second = admission.settings.served_models[:2]
    submitter = OneTopicUnwritable(first)
    admission.marks, admission.answers = cast(Any, NothingCancelled()), cast(Any, Answers())
    admission.submitter, admission.band = cast(Any, submitter), cast(Any, Room())
    admission.quotas, admission.callers = cast(Any, AdmitsAll()), cast(Any, Valid())
    admission._why_unrun = lambda waiting: _none()  # type: ignore[method-assign]
    lines = [(first, "u1"), (first, "u2"), (first, "u3"), (second, "u1")]
    for n, (model, tenant) in enumerate(lines):
        prompt = batch_prompt(admission).model_copy(
            update={"request_id": f"bl_{model}_{tenant}", "model": model}
        )
        admission.queued.add(prompt.request_id, f"0:{n}")
        admission.queues[model].push(tenant, Waiting(0, n, prompt), 0.0)
    forwarding = asyncio.create_task(admission._forward_lines())
    try:
        await asyncio.wait_for(submitter.other_sent.wait(), 10)  # a failure guard only
    finally:
        admission.request_stop()
        await forwarding
        await admission.consumer.stop()  # never started: closed for their finalizers
        await admission.producer.stop()
    assert submitter.sent == [f"bl_{second}_u1"]
    assert submitter.tried[:2] == [first, second], "one try, then the model waits its turn"
    assert admission.queues[first].size == 3, "the refused lines are kept, to go later"


async def test_a_line_is_charged_to_its_user_in_its_keys_tier() -> None:
    """Charged to the user alone, a batch key's lines counted against the same user's
    chat key (and its 60 requests a minute refused every chat while the batch ran)."""
    quotas = AdmitsAll()
    submitter, _, prompt, _ = await forward_once(Valid(), quotas=quotas)
    assert submitter.sent == [prompt.request_id]
    assert quotas.accounts == [f"{prompt.user_id}:{prompt.tier}"]


class RecordingAnswers:
    def __init__(self) -> None:
        self.sent: list[str] = []

    async def unrun(self, prompt: PromptRequest, why: str) -> None:
        self.sent.append(f"{prompt.request_id} {why}")

    async def send(self, owner: str, batch_id: str | None, output: dict[str, Any]) -> None:
        self.sent.append(f"{output['id']} {output['response']['status_code']}")


@pytest.mark.parametrize("taken", [False, True], ids=["not-taken", "taken-by-a-worker"])
async def test_a_line_a_worker_took_before_a_crash_is_answered_by_that_worker_only(
    taken: bool,
) -> None:
    """Forwarded, then admission died before marking it; read again once its batch was
    cancelled, its window over or its key revoked, it was answered so at once, while its
    first copy ran on in a worker and answered 200: two answers under one id, and a
    client keeping the first answer of an id dropped the reply it was charged for."""
    admission = Admission(Settings())
    marks, answers = StandInMarks(), RecordingAnswers()
    marks.taken = frozenset({"bl_1"} if taken else ())
    admission.marks, admission.answers = cast(Any, marks), cast(Any, answers)
    waiting = Waiting(0, 3, batch_prompt(admission))
    try:
        assert await admission._answered_unrun(waiting)  # its batch is cancelled
        await admission._answer_revoked(waiting)
    finally:
        await admission.consumer.stop()  # never started: closed for their finalizers
        await admission.producer.stop()
    assert answers.sent == ([] if taken else ["bl_1 cancelled", "batch_req_bl_1 401"])
