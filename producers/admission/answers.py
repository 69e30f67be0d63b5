"""Answering a batch line that goes no further (refused, or its batch cancelled): its
output on `batch.results`, and in `batch_outputs` where its owner is known, as the
persistence consumer does for the lines that ran."""

from __future__ import annotations

import time
from typing import Any

import orjson
from aiokafka import AIOKafkaProducer

from consumers.history import INSERT_BATCH_OUTPUT, batch_output_row
from schemas import topics
from tandoor.clients import cql


class Answers:
    def __init__(self, producer: AIOKafkaProducer, session: Any) -> None:
        self._producer = producer
        self._session = session
        self._insert = session.prepare(INSERT_BATCH_OUTPUT)

    async def send(self, owner: str | None, batch_id: str | None, output: dict[str, Any]) -> None:
        if owner is not None and batch_id and output.get("custom_id") is not None:
            row = batch_output_row(owner, batch_id, output, time.time_ns() // 1000)
            await cql(self._session, self._insert, row)
        key = batch_id.encode() if batch_id else None
        await self._producer.send_and_wait(topics.BATCH_RESULTS, orjson.dumps(output), key=key)
