"""What a worker answers without running a reply: whom an undecodable prompt's error
goes to, and how the engine's finish reasons read (no engine, no servers)."""

from __future__ import annotations

import orjson
import pytest
from aiokafka.structs import ConsumerRecord

from schemas.codec import SchemaError, decode, encode
from schemas.events import (
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    MessageKey,
    PromptRequest,
    Sampling,
    now_ms,
)
from tests.unit.test_persist_retries import TakingProducer
from tests.unit.test_transcript_records import attempt, prompt
from workers.attempt import usage_of
from workers.engine import finish_reason_of
from workers.prompt_limits import answerable, malformed_final
from workers.publisher import Publisher
from workers.worker import addressee_of

SAMPLE_PROMPT = prompt().model_copy(update={"reply_partition": 0})


def test_an_undecodable_prompts_error_goes_to_the_partition_its_gateway_reads() -> None:
    """It was hashed by the request id: the gateway, which keeps only its own partition,
    never saw it, and the client waited out the silence limit."""
    broken = {"request_id": "r1", "reply_partition": 5, "kind": "a kind from a newer gateway"}
    assert addressee_of(orjson.dumps(broken)) == ("r1", 5)
    assert addressee_of(orjson.dumps({"request_id": "r1", "reply_partition": "5"})) == ("r1", None)
    assert addressee_of(orjson.dumps({"request_id": "r1", "reply_partition": True})) == ("r1", None)
    assert addressee_of(orjson.dumps({"request_id": ""})) is None
    assert addressee_of(b"not JSON") is None


@pytest.mark.parametrize(
    "field", ["request_id", "user_id", "conversation_id", "batch_id", "custom_id"]
)
def test_a_prompt_whose_ids_are_too_long_to_answer_is_undecodable_and_unanswered(
    field: str,
) -> None:
    """Ids key the replies and usage records, which carry them again: a 600 KB id made
    each answer too large for Kafka, and every worker given the partition stopped on it
    in turn. Such a prompt is dead-lettered, and no error final is addressed to it."""
    prompt = {**orjson.loads(encode(SAMPLE_PROMPT)), field: "r" * 600_000}
    with pytest.raises(SchemaError, match=field):
        answerable(decode(PromptRequest, orjson.dumps(prompt)))
    addressed = addressee_of(orjson.dumps(prompt))
    assert addressed is None if field == "request_id" else addressed == (prompt["request_id"], 0)
    assert answerable(decode(PromptRequest, encode(SAMPLE_PROMPT))) == SAMPLE_PROMPT


def test_a_prompt_replacing_a_message_of_an_overlong_id_is_unanswered() -> None:
    key = MessageKey(created_at_ms=1, message_id="m" * 600_000)
    with pytest.raises(SchemaError, match="replaces"):
        answerable(SAMPLE_PROMPT.model_copy(update={"replaces": [key]}))


@pytest.mark.parametrize(
    "change",
    [
        {"model": "m" * 600_000},  # its "unknown model" error and final carry it twice
        {"tier": "t" * 600_000},
        {"replaces": [MessageKey(created_at_ms=i, message_id="m") for i in range(30_000)]},
        # vLLM looks for every stop string at each token, on the worker's event loop.
        {"sampling": Sampling(stop=["x"] * (MAX_STOP_SEQUENCES + 1))},
        {"sampling": Sampling(stop=["x" * (MAX_STOP_CHARS + 1)])},
    ],
    ids=["model", "tier", "replaces", "stop-count", "stop-length"],
)
def test_a_prompt_no_gateway_could_have_made_is_refused_before_it_runs(
    change: dict[str, object],
) -> None:
    """Written straight to the topic: each of these made a final too large for Kafka (every
    worker given the partition stopped on it in turn) or a reply costly for all."""
    field = next(iter(change))
    with pytest.raises(SchemaError, match="stop" if field == "sampling" else field):
        answerable(SAMPLE_PROMPT.model_copy(update=change))


def test_an_undecodable_prompts_error_final_stays_small() -> None:
    """The reason quotes the bad value: 600 KB of backslashes made a 1.2 MB final."""
    with pytest.raises(SchemaError) as refused:
        decode(PromptRequest, orjson.dumps({"v": "\\" * 300_000, "request_id": "r"}))
    assert len(encode(malformed_final("r", "smollm2", str(refused.value)))) < 4096


@pytest.mark.parametrize(
    ("engine", "shown"),
    [
        ("stop", "stop"),
        ("length", "length"),
        ("abort", "cancelled"),
        ("repetition", "stop"),
        (None, "stop"),
        # A request-level failure in the engine read as "stop": a cut reply stored as
        # complete, and a 200 on the OpenAI API where a 502 would have been retried.
        ("error", "error"),
        ("a reason of a newer vLLM", "error"),
    ],
)
def test_the_engines_finish_reasons(engine: str | None, shown: str) -> None:
    assert finish_reason_of(engine) == shown


async def test_an_undecodable_prompt_too_big_to_dead_letter_whole_goes_without_its_value() -> None:
    """A record near Kafka's limit is a dead letter past it once its headers are added:
    refused, it stopped the worker, and every worker given the partition after it."""
    producer = TakingProducer(limit=1_000)
    big = ConsumerRecord("prompts.m", 1, 7, 0, 0, b"k", b"{" * 1_000, None, 1, 1_000, [])
    await Publisher(producer).dead_letter(big, "not JSON")  # type: ignore[arg-type]
    [(topic, value, headers)] = producer.sent
    assert topic == "dead-letter" and value == b""
    assert dict(headers) == {"error": b"not JSON (value too large)", "source": b"prompts.m/1/7"}


def test_a_prompt_that_never_reached_the_engine_reports_no_prompt_tokens() -> None:
    """Stopped or expired while it waited for token budget, or too long for the engine:
    its prompt tokens were reported, settled against the user's quota and counted in
    usage, while the same prompt expired before the worker took it reported none."""
    waited = attempt()
    waited.prompt_tokens = 1000  # rendered, then it waited for room
    assert usage_of(waited).prompt_tokens == 0
    waited.submitted_ms = now_ms()
    assert usage_of(waited).prompt_tokens == 1000
