"""What admission reads from a record's key and headers (the batch id, the caller's key,
the batch's deadline), written by any Kafka client: a value that is not UTF-8 is
absent, a garbled deadline is the line's 400, never an exception."""

from __future__ import annotations

from producers.admission.lines import Refused
from schemas.batch import DEADLINE_HEADER

BAD = "invalid_request_error"

MAX_BATCH_ID_CHARS = 256
MAX_KEY_CHARS = 256  # an Authorization value; keys are far shorter
# A refused id is echoed as its answer's key up to this length: one near Kafka's record
# limit would make an answer too large to send, retried for good in front of every line.
MAX_ANSWER_KEY_CHARS = 16_384


def text_of(value: bytes | None) -> str | None:
    if not value:
        return None
    try:
        return value.decode() or None
    except UnicodeDecodeError:
        return None


def check_batch_id(batch_id: str | None) -> str:
    """The batch id whole, or the line's 400: cut, it was another batch's (results
    under an id its client never reads; two long ids sharing a start, one batch)."""
    if not batch_id:
        raise Refused(400, "no batch id: key the record or set a batch-id header", BAD)
    if len(batch_id) > MAX_BATCH_ID_CHARS:
        message = f"the batch id has {len(batch_id)} characters; at most {MAX_BATCH_ID_CHARS}"
        raise Refused(400, message, BAD, kept=False)
    if "\0" in batch_id:  # it separates the fields a line's request id hashes
        raise Refused(400, "the batch id contains a NUL character", BAD, kept=False)
    return batch_id


def answer_key(batch_id: str | None) -> bytes | None:
    """The key of a line's answer on `batch.results`: its batch id, or none at all."""
    if not batch_id or len(batch_id) > MAX_ANSWER_KEY_CHARS:
        return None
    return batch_id.encode()


def batch_deadline_ms(value: bytes | None) -> int | None:
    text = text_of(value)
    if text is None:
        return None
    if not text.isascii() or not text.isdigit() or len(text) > 15:
        raise Refused(400, f"{DEADLINE_HEADER}: not a time in ms since the epoch", BAD)
    return int(text)


def bearer_token(value: bytes | None) -> str | None:
    """The key, or None; one longer than any key is None (cached, it would hold memory)."""
    text = text_of(value)
    if text and text.lower().startswith("bearer ") and len(text) <= MAX_KEY_CHARS:
        return text[7:].strip() or None
    return None
