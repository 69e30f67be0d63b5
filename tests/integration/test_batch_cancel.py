"""A cancel of a big batch that waits its tenant's quota: its lines are answered
`batch_cancelled` a part per sweep (tests/unit/test_admission_sweep.py), each once,
while another tenant's batch runs. Answered one after another inside the loop that
forwards every tenant's lines, 3,000 of them held the other batch 13 s on machine D
(minutes for the 50,000 lines admission may hold)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer

from infra.roles import AdmissionProcess, PersistProcess, WorkerProcess, running
from producers.batch_topic import ResultsReader, send_lines
from tandoor.policies.redis_keys import batch_cancel_key
from tandoor.settings import Settings
from tests.integration.batch_lines import (
    all_results,
    answered,
    batch_key,
    batch_on_another_partition,
    question,
    slow_tenant,
)
from tests.ops import samples
from tests.waiting import eventually

pytestmark = pytest.mark.integration
HELD = 600  # more than a sweep answers


async def test_a_big_cancelled_batch_is_answered_once_per_line_while_another_runs(
    settings: Settings,
    worker: WorkerProcess,
    producer: AIOKafkaProducer,
    roles_env: dict[str, str],
    results: ResultsReader,
    redis: aioredis.Redis,
    tmp_path: Path,
) -> None:
    env, slow_key, owner = await slow_tenant(settings, roles_env)
    held = f"held-{uuid.uuid4().hex[:6]}"
    other = batch_on_another_partition("other", than=held)
    await send_lines(producer, slow_key, held, [question(worker.model, i) for i in range(HELD)])
    other_key, _ = await batch_key(settings, "other-tenant")
    admission = AdmissionProcess(tmp_path, env)
    async with running([admission, PersistProcess(tmp_path, env)]):
        await all_results(results, held, 1)  # one line ran; the others wait for the quota

        async def waiting_and_answered() -> tuple[float, int]:
            await results.poll()
            found = await samples(admission)
            return found.get("tandoor_admission_waiting_lines", 0.0), len(results.of(held))

        # Every line waiting or answered (a slow start may see a minute pass, and the
        # quota let a second line run).
        await eventually(
            waiting_and_answered, lambda got: sum(got) == HELD, what="every other line waiting"
        )
        await redis.set(batch_cancel_key(owner, held), 1, ex=3600)  # the Batches API's cancel
        await all_results(results, held, 2)  # the cancelled lines are being answered
        await send_lines(producer, other_key, other, [question(worker.model, i) for i in range(2)])
        got_other = await all_results(results, other, 2)
        await all_results(results, held, HELD)
        # A sweep that answered some lines again would do it after the last first answer:
        # read on until admission holds no line of it.
        await eventually(waiting_and_answered, lambda got: got[0] == 0, what="no line left waiting")
        await results.poll()
        cancelled = results.copies(held)
    assert all(answered(r) for r in got_other)
    ran = sum(r["error"] is None for r in cancelled)
    codes = [r["error"]["code"] for r in cancelled if r["error"]]
    assert ran >= 1 and codes == ["batch_cancelled"] * (HELD - ran)
    assert len({r["custom_id"] for r in cancelled}) == len(cancelled) == HELD
