from __future__ import annotations

import orjson
import pytest

from schemas.codec import SchemaError, decode, decode_token_stream, encode, is_final
from schemas.events import (
    ChatMessage,
    ControlEvent,
    Event,
    FinalEvent,
    PromptRequest,
    Sampling,
    TokenEvent,
    Usage,
    UsageRecord,
)

USAGE = Usage(prompt_tokens=12, completion_tokens=3, queue_ms=4.5, ttft_ms=40.0, decode_ms=90.0)


def token(delta: str, seq: int = 0) -> TokenEvent:
    return TokenEvent(
        request_id="r-1", attempt=1, seq=seq, delta=delta, token_count=1, created_at_ms=1
    )


EXAMPLES: list[Event] = [
    PromptRequest(
        request_id="r-1",
        model="smollm2",
        user_id="alice",
        tier="plus",
        band="interactive-paid",
        conversation_id="c-1",
        messages=[
            ChatMessage(role="system", content="Be brief."),
            ChatMessage(role="user", content="Grüße aus Köln — 你好 🙂"),
        ],
        sampling=Sampling(max_tokens=64, temperature=0.0, stop=["\n\n"]),
        created_at_ms=1_764_000_000_000,
        deadline_ms=1_764_000_060_000,
        reply_partition=3,
    ),
    token("Paris"),
    token(""),  # engines emit empty deltas (e.g. a held-back partial character)
    FinalEvent(
        request_id="r-1",
        attempt=2,
        seq=7,
        finish_reason="cancelled",
        text="Par",
        usage=USAGE,
        model="smollm2",
        user_id="alice",
        tier="plus",
        conversation_id="c-1",
        created_at_ms=1,
    ),
    ControlEvent(command="cancel", request_id="r-1", issued_at_ms=5, reason="stop button"),
    UsageRecord(
        request_id="r-1",
        attempt=1,
        user_id="alice",
        tier="plus",
        model="smollm2",
        prompt_tokens=12,
        completion_tokens=3,
        queue_ms=1.0,
        duration_ms=130.0,
        finish_reason="stop",
        finished_at_ms=9,
    ),
]


@pytest.mark.parametrize("event", EXAMPLES, ids=lambda e: type(e).__name__)
def test_every_event_type_round_trips(event: Event) -> None:
    assert decode(type(event), encode(event)) == event


def test_token_stream_decodes_token_and_final_events_by_type() -> None:
    for event in (EXAMPLES[1], EXAMPLES[3]):
        assert decode_token_stream(encode(event)) == event


def test_emoji_split_across_token_events_reassembles() -> None:
    family = "👩‍👩‍👧‍👦"  # one grapheme, seven code points
    flag_and_skin = "🇫🇷👍🏽"
    text = f"ok {family} {flag_and_skin}!"
    # Split at every code point, as a tokenizer may split a grapheme.
    events = [token(ch, seq) for seq, ch in enumerate(text)]
    decoded = [decode_token_stream(encode(e)) for e in events]
    assert "".join(e.delta for e in decoded if isinstance(e, TokenEvent)) == text


def test_events_are_utf8_json_readable_by_any_client() -> None:
    payload = encode(token("naïve ☕"))
    assert orjson.loads(payload)["delta"] == "naïve ☕"
    assert payload.decode("utf-8")


def test_lone_surrogate_is_refused_at_encode() -> None:
    with pytest.raises(SchemaError, match="not encodable"):
        encode(token("\ud83d"))


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        (b"not json", "$"),
        (b"[1, 2]", "$"),
        (b'{"type": "token"}', "v"),
        (b'{"v": "1", "type": "token"}', "v"),
        (
            b'{"v": 1, "request_id": "r", "attempt": "1", "seq": 0, "delta": "", '
            b'"token_count": 1, "created_at_ms": 1}',
            "attempt",
        ),
        (
            b'{"v": 1, "request_id": "r", "attempt": 0, "seq": 0, "delta": "", '
            b'"token_count": 1, "created_at_ms": 1}',
            "attempt",
        ),
        (
            b'{"v": 1, "request_id": "r", "attempt": 1, "seq": 0, '
            b'"token_count": 1, "created_at_ms": 1}',
            "delta",
        ),
    ],
)
def test_malformed_token_events_name_the_field(payload: bytes, field: str) -> None:
    with pytest.raises(SchemaError) as info:
        decode(TokenEvent, payload)
    assert info.value.field == field
    assert f"'{field}'" in str(info.value) or field == "$"


def test_nested_field_errors_name_the_path() -> None:
    prompt = orjson.loads(encode(EXAMPLES[0]))
    prompt["messages"][1]["role"] = "wizard"
    with pytest.raises(SchemaError) as info:
        decode(PromptRequest, orjson.dumps(prompt))
    assert info.value.field == "messages.1.role"


def test_unknown_schema_version_is_rejected() -> None:
    data = orjson.loads(encode(token("x")))
    data["v"] = 2
    with pytest.raises(SchemaError, match="unknown schema version 2") as info:
        decode(TokenEvent, orjson.dumps(data))
    assert info.value.field == "v"


def test_unknown_stream_event_type_is_rejected() -> None:
    with pytest.raises(SchemaError) as info:
        decode_token_stream(b'{"v": 1, "type": "bogus"}')
    assert info.value.field == "type"


def test_additive_fields_from_newer_writers_are_ignored() -> None:
    data = orjson.loads(encode(token("x")))
    data["logprob"] = -0.1
    assert decode(TokenEvent, orjson.dumps(data)) == token("x")


def test_a_record_without_a_value_is_no_final_and_no_event() -> None:
    """A tombstone on `tokens` (any client can write one) was a TypeError in every
    reader that looks for finals first: persistence and the streams app."""
    assert not is_final(None)
    with pytest.raises(SchemaError):
        decode_token_stream(None)  # type: ignore[arg-type]
