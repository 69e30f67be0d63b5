"""The sweep that answers waiting lines of a cancelled batch, with stand-ins for the
stores (the real ones: tests/integration/test_batch_cancel.py). It answered every such
line, one after another, inside the loop that forwards every tenant's lines: a cancel
of 50,000 waiting lines held all other batches for minutes."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from producers.admission.answers import unrun_lines
from producers.admission.marks import LineMarks
from producers.admission.role import Admission
from producers.admission.sweep import ANSWERS_AT_ONCE, ANSWERS_PER_SWEEP
from producers.admission.waiting import Waiting
from schemas.events import PromptRequest
from tandoor.settings import Settings
from tests.unit.test_admission_forward import StandInMarks, batch_prompt

LINES = 600


class CountingAnswers:
    def __init__(self) -> None:
        self.answered: list[str] = []
        self.busy = self.most_busy = 0

    async def unrun(self, prompt: Any, why: str) -> None:
        self.busy += 1
        self.most_busy = max(self.most_busy, self.busy)
        await asyncio.sleep(0)  # a store's round trip
        self.busy -= 1
        self.answered.append(prompt.request_id)


async def test_a_big_cancelled_batch_is_answered_a_bounded_part_per_sweep() -> None:
    admission = Admission(Settings())
    answers = CountingAnswers()
    admission.marks = cast(Any, StandInMarks())
    admission.answers = cast(Any, answers)
    first = batch_prompt(admission)
    for offset in range(LINES):
        prompt = first.model_copy(update={"request_id": f"bl_{offset}"})
        admission.queued.add(prompt.request_id, f"0:{offset}")
        admission.queues[prompt.model].push("u", Waiting(0, offset, prompt), 0.0)
    try:
        sweeps = [await admission._answer_unrunnable()]
        after_one = len(answers.answered)
        while sweeps[-1]:
            sweeps.append(await admission._answer_unrunnable())
    finally:
        await admission.consumer.stop()  # never started: closed for their finalizers
        await admission.producer.stop()
    assert after_one == ANSWERS_PER_SWEEP, "forwarding goes on between sweeps"
    assert sweeps == [True, True, False]
    assert sorted(answers.answered) == sorted(f"bl_{i}" for i in range(LINES))  # each once
    assert 1 < answers.most_busy <= ANSWERS_AT_ONCE
    assert admission.queues[first.model].size == 0


class CountingRedis:
    """Redis as LineMarks uses it, counting round trips; batches "c..." are cancelled."""

    def __init__(self) -> None:
        self.round_trips = 0
        self._asked: list[str] = []

    def pipeline(self, transaction: bool = True) -> CountingRedis:
        return self

    async def __aenter__(self) -> CountingRedis:
        return self

    async def __aexit__(self, *_: object) -> None:
        return None

    def exists(self, key: str) -> None:
        self._asked.append(key)

    async def execute(self) -> list[int]:
        self.round_trips += 1
        asked, self._asked = self._asked, []
        return [int(key.rsplit(":", 1)[-1].startswith("c")) for key in asked]


async def test_a_sweep_asks_redis_once_however_many_batches_wait() -> None:
    """One EXISTS a batch, one after another: 20,000 one-line batches took seconds of
    the forwarding task's time, every second."""
    redis = CountingRedis()
    prompts = [batch_prompt_of(f"bl_{i}", f"{'c' if i % 3 == 0 else 'b'}{i}") for i in range(3000)]
    unrun = await unrun_lines(LineMarks(redis), prompts, now=0)
    assert redis.round_trips == 1
    assert sorted(unrun) == sorted(f"bl_{i}" for i in range(0, 3000, 3))
    assert set(unrun.values()) == {"cancelled"}


def batch_prompt_of(request_id: str, batch_id: str) -> PromptRequest:
    return PromptRequest.model_validate(
        {
            "request_id": request_id,
            "model": "smollm2",
            "user_id": "u",
            "tier": "batch",
            "band": "batch",
            "conversation_id": request_id,
            "messages": [{"role": "user", "content": "Hi"}],
            "sampling": {"max_tokens": 4},
            "created_at_ms": 1,
            "batch_id": batch_id,
            "custom_id": request_id,
        }
    )
