"""JSON Schema files for every topic's events, generated from the models in
schemas/events.py, for analytics teams who read the topics without this code.

    python -m schemas.json_schemas      # writes schemas/json/<Event>.v<version>.json

One file per event type and schema version. A version's file may only change
compatibly (the rule in schemas/events.py: adding an optional field); the generator
refuses anything else until the event's SCHEMA_VERSION is bumped, which starts a new
file and keeps the old one for readers of older events.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from schemas import topics
from schemas.events import (
    ControlEvent,
    FinalEvent,
    PromptRequest,
    RollupSummary,
    TokenEvent,
    UsageRecord,
)

FOLDER = Path(__file__).parent / "json"
# Each topic and the event types on it.
TOPIC_EVENTS: dict[str, list[type[BaseModel]]] = {
    f"{topics.PROMPTS_PREFIX}<model>": [PromptRequest],
    topics.TOKENS: [TokenEvent, FinalEvent],
    topics.CONTROL: [ControlEvent],
    topics.USAGE: [UsageRecord],
    topics.USAGE_ROLLUPS: [RollupSummary],
}
Schema = dict[str, Any]


def version_of(model: type[BaseModel]) -> int:
    return int(getattr(model, "SCHEMA_VERSION"))  # noqa: B009 (a ClassVar, not a field)


def schema_file(model: type[BaseModel]) -> Path:
    return FOLDER / f"{model.__name__}.v{version_of(model)}.json"


def generate(model: type[BaseModel]) -> Schema:
    """What a reader accepts (fields with a default may be absent)."""
    on = [topic for topic, models in TOPIC_EVENTS.items() if model in models]
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"urn:tandoor:schema:{model.__name__}:v{version_of(model)}",
        "x-topics": on,
        "x-version": version_of(model),
        **model.model_json_schema(mode="validation"),
    }


def incompatibilities(old: Schema, new: Schema, where: str = "") -> list[str]:
    """How `new` breaks readers or writers of `old`: a field removed, retyped or newly
    required, in the event or any object it holds. Adding an optional field is fine."""
    problems: list[str] = []
    old_fields, new_fields = old.get("properties", {}), new.get("properties", {})
    for name, field in old_fields.items():
        if name not in new_fields:
            problems.append(f"{where}{name}: removed")
        elif _shape(field) != _shape(new_fields[name]):
            problems.append(f"{where}{name}: type changed")
    for name in sorted(set(new.get("required", [])) - set(old.get("required", []))):
        problems.append(f"{where}{name}: newly required")
    old_defs, new_defs = old.get("$defs", {}), new.get("$defs", {})
    for name, definition in old_defs.items():
        if name in new_defs:
            problems += incompatibilities(definition, new_defs[name], f"{where}{name}.")
    return problems


def _shape(field: Schema) -> Schema:
    """A field's schema without what does not change the data (titles, descriptions,
    defaults: a default only matters to whether the field is required)."""
    ignored = {"title", "description", "default"}
    return {
        k: ([_shape(v) for v in value] if isinstance(value, list) and k == "anyOf" else value)
        for k, value in field.items()
        if k not in ignored
    }


def check(model: type[BaseModel]) -> tuple[Schema, list[str]]:
    """The generated schema, and what stands in the way of writing it."""
    schema, path = generate(model), schema_file(model)
    if not path.exists():
        return schema, []
    committed = json.loads(path.read_text())
    problems = incompatibilities(committed, schema)
    if problems:
        problems.insert(
            0,
            f"{model.__name__} changed incompatibly with {path.name}: bump its "
            "SCHEMA_VERSION (readers of older events keep the old file)",
        )
    return schema, problems


def write_all() -> list[str]:
    problems: list[str] = []
    FOLDER.mkdir(exist_ok=True)
    for model in {m for models in TOPIC_EVENTS.values() for m in models}:
        schema, refused = check(model)
        if refused:
            problems += refused
            continue
        schema_file(model).write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
    return problems


if __name__ == "__main__":
    refused = write_all()
    print("\n".join(refused) or f"schemas written to {FOLDER}")
    sys.exit(1 if refused else 0)
