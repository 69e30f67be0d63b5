"""Files and batches as OpenAI's API shows them, from what is stored: a batch's
status and counts come from its lines' answers."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import re2

from producers.gateway.batches.records import Answered, StoredBatch, StoredFile
from tandoor.clients import TRANSACTION_TIMEOUT_MS

COMPLETION_WINDOW = dt.timedelta(hours=24)
# Longer than a line generates (a reply's max_tokens at a slow engine's pace).
EXPIRED_SETTLE_AFTER = dt.timedelta(hours=2)
# A batch still queuing this long after its creation never will be: its gateway died
# before its lines' transaction was committed, and Kafka has aborted it by now.
QUEUING_LIMIT = dt.timedelta(milliseconds=2 * TRANSACTION_TIMEOUT_MS)
NOT_QUEUED = {
    "object": "list",
    "data": [
        {
            "code": "queuing_interrupted",
            "message": "the gateway stopped while queuing this batch, or could not record "
            "that it had: if its lines were queued they may still run; cancel it, then "
            "create it again",
            "param": None,
            "line": None,
        }
    ],
}
OUTPUT_PREFIX, ERROR_PREFIX = "file-out-", "file-err-"  # a batch's files, made when read
EPOCH = dt.datetime(1970, 1, 1)  # naive UTC, as the stored times are


def batch_object(batch: StoredBatch, answered: Answered) -> dict[str, Any]:
    """OpenAI's batch object, from the lines answered so far."""
    completed, failed = answered.succeeded, answered.failed
    status = _status(batch, answered)
    final = status in ("completed", "cancelled", "expired")
    failed_at = epoch(batch.created_at + QUEUING_LIMIT) if status == "failed" else None
    created, expires = epoch(batch.created_at), epoch(batch.created_at + COMPLETION_WINDOW)
    cancel_shown = status in ("cancelling", "cancelled")
    cancelling = epoch(batch.cancelled_at) if batch.cancelled_at and cancel_shown else None
    return {
        "id": batch.batch_id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "errors": NOT_QUEUED if status == "failed" else None,
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": status,
        "output_file_id": OUTPUT_PREFIX + batch.batch_id if final and completed else None,
        "error_file_id": ERROR_PREFIX + batch.batch_id if final and failed else None,
        "created_at": created,
        "in_progress_at": created,
        "expires_at": expires,
        "finalizing_at": None,
        "completed_at": epoch(answered.last_at or utc_now()) if status == "completed" else None,
        "failed_at": failed_at,
        "expired_at": expires if status == "expired" else None,
        "cancelling_at": cancelling,
        "cancelled_at": cancelling if status == "cancelled" else None,
        "request_counts": {"total": batch.total, "completed": completed, "failed": failed},
        "metadata": batch.metadata,
    }


def is_settled(batch: StoredBatch, answered: Answered) -> bool:
    """No answer can change these counts any more: every line is answered, and the
    batch is completed or cancelled, or expired for longer than a line still running at
    the window's end (one an admission replay answered `batch_expired` meanwhile) takes
    to finish. Unsettled, every read counts all its lines again (50,000 rows a batch,
    for every batch on a page of the list, for good)."""
    if answered.count < batch.total:
        return False
    status = _status(batch, answered)
    if status == "expired":
        return utc_now() > batch.created_at + COMPLETION_WINDOW + EXPIRED_SETTLE_AFTER
    return status in ("completed", "cancelled")


def lines_waiting(batch: StoredBatch, answered: int) -> int:
    """A batch's lines not yet answered (waiting in Kafka, in admission or in a
    worker), given how many are: within its completion window, a batch's unanswered
    lines are all still to be answered (a cancel's quickly), unless its lines never
    reached Kafka (`failed`)."""
    if batch.queuing and not answered and _never_queued(batch):
        return 0
    return max(0, batch.total - answered)


def _never_queued(batch: StoredBatch) -> bool:
    """Still marked queuing past QUEUING_LIMIT (to be asked with no line answered)."""
    return utc_now() > batch.created_at + QUEUING_LIMIT


def _status(batch: StoredBatch, answered: Answered) -> str:
    if batch.queuing and not answered.count:  # an answer: its lines were committed
        interrupted = _never_queued(batch)  # none of them ran
        if batch.cancelled_at is not None:
            return "cancelled" if interrupted else "cancelling"
        return "failed" if interrupted else "validating"
    done = answered.count >= batch.total
    window_end = batch.created_at + COMPLETION_WINDOW
    if _cancelled_in_time(batch, answered, done):  # unanswered lines end with the window
        return "cancelled" if done or utc_now() > window_end else "cancelling"
    # A line with no HTTP answer in a batch not cancelled is one the window ended
    # (`batch_expired`). Expired is final: lines still running at the window's end
    # that finish later are counted, and the batch does not turn `completed` (clients
    # stop polling at expired and would never see it).
    last = answered.last_at
    in_window = last is None or last.replace(tzinfo=None) <= window_end
    if utc_now() > window_end and not (done and not answered.unstatused and in_window):
        return "expired"
    return "completed" if done else "in_progress"


def _cancelled_in_time(batch: StoredBatch, answered: Answered, done: bool) -> bool:
    """A cancel counts unless every line was answered before it: it read the batch in
    progress, the last line finished meanwhile, and clients saw it completed."""
    if batch.cancelled_at is None:
        return False
    last = answered.last_at
    return not (done and last is not None and last.replace(tzinfo=None) <= batch.cancelled_at)


def page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """OpenAI's cursor page: the next one starts `after` its last id."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def file_object(stored: StoredFile) -> dict[str, Any]:
    return {
        "id": stored.file_id,
        "object": "file",
        "bytes": stored.bytes,
        "created_at": epoch(stored.created_at),
        "filename": stored.filename,
        "purpose": stored.purpose,
        "status": "processed",
    }


def new_file_id(created: dt.datetime) -> str:
    """An upload's id names its millisecond, so a page may end at a deleted file."""
    ms = (created - EPOCH) // dt.timedelta(milliseconds=1)
    return f"file-t{ms:012x}{uuid.uuid4().hex[:20]}"  # "t": no uuid4 hex id looks so


def file_created(file_id: str) -> dt.datetime | None:
    """When a file with this id was uploaded, if its id says so."""
    stamp = re2.fullmatch(r"file-t([0-9a-f]{12})[0-9a-f]{20}", file_id)
    if stamp is None:
        return None  # an id from before ids named their time
    try:
        return EPOCH + dt.timedelta(milliseconds=int(stamp.group(1), 16))
    except OverflowError:  # past the year 9999: no id of ours
        return None


def utc_now() -> dt.datetime:
    """Naive UTC to the millisecond, as Cassandra's driver gives timestamps back."""
    now = dt.datetime.now(dt.UTC).replace(tzinfo=None)
    return now.replace(microsecond=now.microsecond // 1000 * 1000)


def window_end_ms(batch: StoredBatch) -> int:
    """When its completion window ends, to the millisecond: admission expires its lines
    from then (in whole seconds, rounded down, lines answered `batch_expired` before
    the window's end showed the batch `completed`, then `expired`)."""
    end = (batch.created_at + COMPLETION_WINDOW).replace(tzinfo=dt.UTC)
    return round(end.timestamp() * 1000)


def epoch(at: dt.datetime) -> int:
    return int(at.replace(tzinfo=dt.UTC).timestamp())
