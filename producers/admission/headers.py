"""What admission reads from a record's key and headers (the batch id, the caller's key,
the batch's deadline), written by any Kafka client: a value that is not UTF-8 is
absent, a garbled deadline is the line's 400, never an exception."""

from __future__ import annotations

from producers.admission.lines import Refused
from schemas.batch import DEADLINE_HEADER

MAX_TEXT_CHARS = 256


def text_of(value: bytes | None) -> str | None:
    if not value:
        return None
    try:
        return value.decode()[:MAX_TEXT_CHARS] or None
    except UnicodeDecodeError:
        return None


def batch_deadline_ms(value: bytes | None) -> int | None:
    text = text_of(value)
    if text is None:
        return None
    if not text.isascii() or not text.isdigit() or len(text) > 15:
        raise Refused(
            400, f"{DEADLINE_HEADER}: not a time in ms since the epoch", "invalid_request_error"
        )
    return int(text)


def bearer_token(value: bytes | None) -> str | None:
    text = text_of(value)
    if text and text.lower().startswith("bearer "):
        return text[7:].strip() or None
    return None
