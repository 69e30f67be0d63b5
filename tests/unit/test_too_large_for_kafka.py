"""Records Kafka refuses for their size on every try, with stand-ins for the producer
(aiokafka raises MessageSizeTooLargeError before sending; the real path:
tests/integration/test_batch_topic_hostile.py). Retried as if Kafka were down, one such
record held every batch line behind it for good."""

from __future__ import annotations

from typing import Any, cast

import orjson
from aiokafka.errors import MessageSizeTooLargeError

from producers.admission.answers import Answers
from producers.admission.lines import Refused
from producers.prompts import PromptSubmitter
from schemas.batch import refused_output
from schemas.errors import MAX_MESSAGE_CHARS, MAX_PARAM_CHARS
from tandoor.settings import Settings
from tests.unit.test_admission_forward import AdmitsAll, Valid, forward_once


class RefusesLarge:
    """A producer whose record limit is `limit` bytes."""

    def __init__(self, limit: int = 1_000) -> None:
        self.limit = limit
        self.sent: list[bytes] = []

    async def partitions_for(self, topic: str) -> set[int]:
        return set(range(64))

    async def send_and_wait(self, topic: str, value: bytes, **_: Any) -> None:
        if len(value) > self.limit:
            raise MessageSizeTooLargeError(f"{len(value)} bytes")
        self.sent.append(value)


def test_a_refusal_quoting_huge_input_is_bounded() -> None:
    """A model name of 160,000 characters, each written as six by repr() and escaped
    again in JSON, made a 1.1 MB answer from a 320 KB line."""
    model = "\u0378" * 160_000
    refused = Refused(404, f"model {model!r} does not exist", "invalid_request_error")
    output = refused_output("c", "bl_1", 404, refused.message, refused.kind, "f" * 900_000)
    error = output["response"]["body"]["error"]
    assert len(error["message"]) <= MAX_MESSAGE_CHARS and error["message"].startswith("model '")
    assert len(error["param"]) <= MAX_PARAM_CHARS
    assert len(orjson.dumps(output)) < 4 * MAX_MESSAGE_CHARS


async def test_an_answer_too_large_for_kafka_goes_as_an_error_in_its_place() -> None:
    producer = RefusesLarge()
    answers = Answers(cast(Any, producer), cast(Any, Prepares()))
    output = refused_output("line-0", "bl_1", 400, "x" * 900)
    await answers.send(None, "b1", {**output, "padding": "y" * 2_000})
    (sent,) = [orjson.loads(value) for value in producer.sent]
    assert sent["custom_id"] == "line-0" and sent["id"] == "batch_req_bl_1"
    assert sent["error"]["code"] == "result_too_large"


async def test_a_batch_prompt_too_large_for_kafka_is_answered_413_once() -> None:
    """Forwarding retried it each second for good, held in front of every model's
    lines; now the line is answered, its charge refunded, and it is not sent again."""
    submitter = PromptSubmitter(Settings(), cast(Any, RefusesLarge(limit=100)))
    _, answers, prompt, admission = await forward_once(Valid(), submitter=submitter)
    (output,) = answers.sent
    assert output["response"]["status_code"] == 413, output
    assert "bytes encoded" in output["response"]["body"]["error"]["message"]
    assert admission.queued.where(prompt.request_id) is None
    assert cast(AdmitsAll, admission.quotas).refunded == [prompt.request_id]


class Prepares:
    def prepare(self, query: str) -> str:
        return query
