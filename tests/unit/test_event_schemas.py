"""The JSON Schema files analytics teams read (schemas/json/) are generated from
schemas/events.py, describe the events the code writes, and change only compatibly
unless the event's version is bumped."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import orjson
import pytest
from jsonschema import Draft202012Validator  # type: ignore[import-untyped]
from pydantic import BaseModel

from schemas import json_schemas
from schemas.codec import encode
from schemas.events import (
    ChatMessage,
    ControlEvent,
    FinalEvent,
    PromptRequest,
    RollupSummary,
    TokenEvent,
    Usage,
    UsageRecord,
)
from schemas.json_schemas import TOPIC_EVENTS, check, generate, incompatibilities, schema_file
from streams.rollups import Rollup

EVERY_MODEL = sorted({m for ms in TOPIC_EVENTS.values() for m in ms}, key=lambda m: m.__name__)
USAGE = Usage(prompt_tokens=5, completion_tokens=3, cached_tokens=2, queue_ms=1, decode_ms=4)
SAMPLES: list[BaseModel] = [
    PromptRequest(
        request_id="r1",
        model="smollm2",
        user_id="u",
        tier="plus",
        band="interactive-paid",
        conversation_id="c",
        messages=[ChatMessage(role="user", content="hi")],
        created_at_ms=1,
    ),
    TokenEvent(request_id="r1", attempt=1, seq=0, delta="He", token_count=1, created_at_ms=2),
    FinalEvent(
        request_id="r1",
        attempt=1,
        seq=1,
        finish_reason="stop",
        text="Hello",
        usage=USAGE,
        model="smollm2",
        user_id="u",
        tier="plus",
        conversation_id="c",
        created_at_ms=3,
    ),
    ControlEvent(command="cancel", request_id="r1", issued_at_ms=4),
    UsageRecord(
        request_id="r1",
        attempt=1,
        user_id="u",
        tier="plus",
        model="smollm2",
        prompt_tokens=5,
        completion_tokens=3,
        cached_tokens=2,
        queue_ms=1,
        duration_ms=9,
        finish_reason="stop",
        finished_at_ms=5,
    ),
]


def committed(model: type[BaseModel]) -> Draft202012Validator:
    return Draft202012Validator(json.loads(schema_file(model).read_text()))


@pytest.mark.parametrize("model", EVERY_MODEL, ids=lambda m: m.__name__)
def test_the_committed_schema_is_what_the_code_generates(model: type[BaseModel]) -> None:
    schema, problems = check(model)
    assert not problems, "\n".join(problems)
    on_disk = json.loads(schema_file(model).read_text())
    assert on_disk == schema, "run `python -m schemas.json_schemas` and commit schemas/json/"


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: type(e).__name__)
def test_what_the_code_writes_is_valid_against_its_schema(event: BaseModel) -> None:
    validator = committed(type(event))
    assert not list(validator.iter_errors(orjson.loads(encode(event))))  # type: ignore[arg-type]
    incomplete = orjson.loads(encode(event))  # type: ignore[arg-type]
    del incomplete["request_id"]
    assert not validator.is_valid(incomplete), "the schema requires what readers need"


def test_a_rollup_as_the_streams_app_writes_it_is_valid() -> None:
    rollup = Rollup("1m", 120_000, "user", "ada")
    rollup.add(SAMPLES[-1])  # type: ignore[arg-type]
    summary = rollup.summary()
    assert not list(committed(RollupSummary).iter_errors(summary))
    assert RollupSummary.model_validate(summary).model_dump() == summary


def test_adding_an_optional_field_is_compatible() -> None:
    old = generate(UsageRecord)
    new = copy.deepcopy(old)
    new["properties"]["region"] = {"type": "string", "default": "eu"}
    assert incompatibilities(old, new) == []


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda s: s["properties"].pop("queue_ms"), "queue_ms: removed"),
        (lambda s: s["properties"]["attempt"].update(type="string"), "attempt: type changed"),
        (lambda s: s["required"].append("batch_id"), "batch_id: newly required"),
        (lambda s: s["properties"]["kind"]["enum"].pop(), "kind: type changed"),
    ],
)
def test_breaking_changes_are_found(change: object, problem: str) -> None:
    old = generate(UsageRecord)
    new = copy.deepcopy(old)
    change(new)  # type: ignore[operator]
    assert problem in incompatibilities(old, new)


def test_a_breaking_change_inside_a_nested_object_is_found() -> None:
    old = generate(FinalEvent)
    new = copy.deepcopy(old)
    new["$defs"]["Usage"]["properties"].pop("cached_tokens")
    assert incompatibilities(old, new) == ["Usage.cached_tokens: removed"]


def test_the_generator_refuses_a_breaking_change_without_a_version_bump(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    published = generate(UsageRecord)
    published["properties"]["region"] = {"type": "string"}  # a field the code dropped
    monkeypatch.setattr(json_schemas, "FOLDER", tmp_path)
    schema_file(UsageRecord).write_text(json.dumps(published))
    _, problems = check(UsageRecord)
    assert problems[0].startswith("UsageRecord changed incompatibly with UsageRecord.v1.json")
    assert "region: removed" in problems
    assert json_schemas.write_all() == problems
    assert json.loads(schema_file(UsageRecord).read_text()) == published, "left as it was"
