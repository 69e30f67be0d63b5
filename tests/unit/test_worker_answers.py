"""What a worker answers without running a reply: whom an undecodable prompt's error
goes to, and how the engine's finish reasons read (no engine, no servers)."""

from __future__ import annotations

import orjson
import pytest

from workers.request import finish_reason_of
from workers.worker import addressee_of


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
