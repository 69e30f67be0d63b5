"""orjson (de)serialization of events, with errors that name the offending field."""

from __future__ import annotations

from typing import Any, TypeVar

import orjson
from pydantic import ValidationError

from schemas.events import Event, FinalEvent, TokenEvent, TokenStreamEvent

E = TypeVar("E", bound=Event)


# How a final event is told from a token event in raw bytes, without decoding: orjson
# writes this pair exactly, and it cannot occur inside a JSON string (quotes are escaped).
FINAL_MARKER = b'"type":"final"'


def is_final(payload: bytes | None) -> bool:
    """Whether an encoded `tokens` event is a FinalEvent (cheap: no parsing). A record
    with no value (a tombstone any client can write) is none."""
    return payload is not None and FINAL_MARKER in payload


class SchemaError(ValueError):
    """A payload that cannot be decoded into the expected event; `field` names where."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def encode(event: Event) -> bytes:
    try:
        return orjson.dumps(event.model_dump())
    except orjson.JSONEncodeError as exc:
        # Lone surrogates cannot be UTF-8: refuse them here, not in every reader.
        raise SchemaError(f"{type(event).__name__} is not encodable: {exc}", "$") from exc


def decode(model: type[E], data: bytes | str) -> E:
    return _validate(model, _load_object(model, data))


def _validate(model: type[E], obj: dict[str, Any]) -> E:
    _check_version(model, obj)
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise _schema_error(model, exc) from exc


_STREAM_TYPES: dict[str, type[TokenEvent] | type[FinalEvent]] = {
    "token": TokenEvent,
    "final": FinalEvent,
}


def decode_token_stream(data: bytes | str) -> TokenStreamEvent:
    """Decode an event of the `tokens` topic, which carries token and final events."""
    obj = _load_object(TokenEvent, data)
    kind = obj.get("type")
    model = _STREAM_TYPES.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise SchemaError(
            f"token stream event: field 'type': expected one of {sorted(_STREAM_TYPES)}, "
            f"got {kind!r}",
            "type",
        )
    return _validate(model, obj)


def _load_object(model: type[Event], data: bytes | str) -> dict[str, Any]:
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise SchemaError(f"{model.__name__}: payload is not valid JSON: {exc}", "$") from exc
    if not isinstance(obj, dict):
        raise SchemaError(
            f"{model.__name__}: payload must be a JSON object, got {type(obj).__name__}", "$"
        )
    return obj


def _check_version(model: type[Event], obj: dict[str, Any]) -> None:
    version = obj.get("v")
    if type(version) is not int:
        raise SchemaError(
            f"{model.__name__}: field 'v': schema version must be an integer, got {version!r}", "v"
        )
    if version != model.SCHEMA_VERSION:
        raise SchemaError(
            f"{model.__name__}: field 'v': unknown schema version {version}; "
            f"this build reads version {model.SCHEMA_VERSION}",
            "v",
        )


def _schema_error(model: type[Event], exc: ValidationError) -> SchemaError:
    first = exc.errors()[0]
    field = ".".join(str(part) for part in first["loc"]) or "$"
    return SchemaError(f"{model.__name__}: field '{field}': {first['msg']}", field)
