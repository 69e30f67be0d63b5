"""Answering a batch line that goes no further (refused, its batch cancelled or its
window over): its output on `batch.results`, and in `batch_outputs` where its owner is
known, as the persistence consumer does for the lines that ran."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any, Literal

import orjson
from aiokafka.errors import KafkaError, MessageSizeTooLargeError

from consumers.history import INSERT_BATCH_OUTPUT, batch_output_row, batch_output_written_us
from producers.admission.headers import answer_key
from producers.admission.marks import LineMarks
from schemas import topics
from schemas.batch import cancelled_output, expired_output, too_large_output
from schemas.events import PromptRequest
from tandoor.clients import CASSANDRA_DOWN, REDIS_DOWN, cql
from tandoor.renewing_producer import RenewingProducer

log = logging.getLogger(__name__)

# Stores a line's step may wait for: it is tried again, never dropped.
UNREACHABLE = (*REDIS_DOWN, KafkaError, *CASSANDRA_DOWN)
Unrun = Literal["cancelled", "expired"]  # why a line is answered without running


class Answers:
    def __init__(self, producer: RenewingProducer, session: Any) -> None:
        self._producer = producer
        self._session = session
        self._insert = session.prepare(INSERT_BATCH_OUTPUT)

    async def send(self, owner: str | None, batch_id: str | None, output: dict[str, Any]) -> None:
        if owner is not None and batch_id and output.get("custom_id") is not None:
            written_us = batch_output_written_us(0, 0, orjson.dumps(output).decode())
            row = batch_output_row(owner, batch_id, output, written_us, time.time_ns() // 10**6)
            await cql(self._session, self._insert, row)
        key, value = answer_key(batch_id), orjson.dumps(output)
        try:
            await self._producer.send_and_wait(topics.BATCH_RESULTS, value, key=key)
        except MessageSizeTooLargeError:  # refused again on every try: in front of every line
            log.error("answer to %s too large for Kafka (%d bytes)", output["id"], len(value))
            request_id = output["id"].removeprefix("batch_req_")
            small = too_large_output(output.get("custom_id"), request_id, len(value))
            await self._producer.send_and_wait(topics.BATCH_RESULTS, orjson.dumps(small), key=key)

    async def unrun(self, prompt: PromptRequest, why: Unrun) -> None:
        output = cancelled_output if why == "cancelled" else expired_output
        await self.send(
            prompt.user_id, prompt.batch_id, output(prompt.custom_id, prompt.request_id)
        )


async def why_unrun(marks: LineMarks, prompt: PromptRequest, now: int) -> Unrun | None:
    """Why a line must not run: its batch was cancelled, or its window is over."""
    return (await unrun_lines(marks, [prompt], now)).get(prompt.request_id)


async def unrun_lines(
    marks: LineMarks, prompts: Iterable[PromptRequest], now: int
) -> dict[str, Unrun]:
    """Why each line must not run (by request id; absent where it may run): its batch
    was cancelled, or its window is over. Redis is asked once for all their batches."""
    prompts = list(prompts)
    cancelled = await marks.cancelled_batches((p.user_id, p.batch_id) for p in prompts)
    unrun: dict[str, Unrun] = {}
    for prompt in prompts:
        if (prompt.user_id, prompt.batch_id) in cancelled:
            unrun[prompt.request_id] = "cancelled"
        elif _past_deadline(prompt, now):
            unrun[prompt.request_id] = "expired"
    return unrun


def _past_deadline(prompt: PromptRequest, now: int) -> bool:
    return prompt.deadline_ms is not None and now > prompt.deadline_ms
