"""OpenAI's error body, as every surface answers a refused request: over HTTP, and as a
batch line's result on Kafka. A message may quote what the client sent (a model name, a
field's path): it is bounded, so that no input makes an answer larger than Kafka takes
(a batch line's answer past the record limit was retried for good, in front of every
line behind it)."""

from __future__ import annotations

from typing import Any

MAX_MESSAGE_CHARS = 1_000
MAX_PARAM_CHARS = 200


def shortened(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[: limit - 1]}…"


def error_body(
    message: str, kind: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """`code` as OpenAI's where one applies (model_not_found, invalid_api_key,
    rate_limit_exceeded, context_length_exceeded): clients branch on it."""
    bounded_param = None if param is None else shortened(param, MAX_PARAM_CHARS)
    return {
        "error": {
            "message": shortened(message, MAX_MESSAGE_CHARS),
            "type": kind,
            "param": bounded_param,
            "code": code,
        }
    }
