"""What the Batches API says of a batch and of its input file, without servers."""

from __future__ import annotations

import codecs
import dataclasses
import datetime as dt
import tracemalloc

import orjson
import pytest

from producers.gateway.batches.input_file import MAX_LINES, input_lines
from producers.gateway.batches.objects import batch_object, is_settled
from producers.gateway.batches.records import Answered, StoredBatch
from producers.gateway.errors import ApiError
from schemas.batch import MAX_LINE_BYTES

URL = "/v1/chat/completions"


def batch(age: dt.timedelta, cancelled: bool) -> StoredBatch:
    created = dt.datetime.now(dt.UTC).replace(tzinfo=None) - age  # naive, as Cassandra gives
    return StoredBatch("b", "u", "f", URL, "24h", 3, None, created, created if cancelled else None)


@pytest.mark.parametrize(
    ("age_h", "cancelled", "status"),
    [
        (1, False, "in_progress"),
        (25, False, "expired"),
        (1, True, "cancelling"),
        # Lines that never reach admission are never answered: the window ends it.
        (25, True, "cancelled"),
    ],
)
def test_a_batch_with_lines_unanswered_ends_with_its_window(
    age_h: int, cancelled: bool, status: str
) -> None:
    shown = batch_object(batch(dt.timedelta(hours=age_h), cancelled), Answered.of([200]))
    assert shown["status"] == status
    assert shown["request_counts"] == {"total": 3, "completed": 1, "failed": 0}


def test_an_expired_batch_stays_expired_once_its_unrun_lines_are_answered() -> None:
    """Past the window, admission answers the lines not run yet `batch_expired` (no HTTP
    answer): every line is then answered, and the batch is still expired, not completed."""
    late = batch(dt.timedelta(hours=25), cancelled=False)
    shown = batch_object(late, Answered.of([200, None, None]))
    assert shown["status"] == "expired" and shown["completed_at"] is None
    assert shown["request_counts"] == {"total": 3, "completed": 1, "failed": 2}
    done_at = dt.datetime(2026, 12, 1, 12, tzinfo=dt.UTC)
    completed = batch_object(late, Answered.of([200, 400, 200], done_at))
    assert completed["status"] == "completed"  # every line ran
    assert completed["completed_at"] == int(done_at.timestamp())  # when, not "now"


def line(custom_id: str, content: str) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": content}]}
    return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": URL, "body": body})


def test_a_line_kafka_would_refuse_is_a_400_naming_it() -> None:
    """One record per line: past the limit, Kafka refused it mid-batch, after the lines
    before it were queued."""
    fits = line("a", "x" * (MAX_LINE_BYTES - 200))
    assert input_lines(fits + b"\n", URL) == [fits]
    with pytest.raises(ApiError, match=r"line 2 is 1000\d{3} bytes: at most 1000000") as error:
        input_lines(fits + b"\n" + line("b", "x" * MAX_LINE_BYTES) + b"\n", URL)
    assert error.value.status == 400


def test_an_expired_batch_does_not_turn_completed_when_its_running_lines_finish() -> None:
    """Lines still generating at the window's end: the batch read expired (final: the
    SDK and `tandoor batch collect` stop there), then completed once they finished."""
    late = batch(dt.timedelta(hours=25), cancelled=False)
    window_end = (late.created_at + dt.timedelta(hours=24)).replace(tzinfo=dt.UTC)
    assert batch_object(late, Answered.of([200, 200]))["status"] == "expired"
    finished_late = Answered.of([200, 200, 200], window_end + dt.timedelta(minutes=5))
    shown = batch_object(late, finished_late)
    assert shown["status"] == "expired" and shown["completed_at"] is None
    assert shown["request_counts"] == {"total": 3, "completed": 3, "failed": 0}


def test_a_file_of_too_many_lines_is_refused_without_parsing_the_rest() -> None:
    """A 64 MB file of tiny lines was parsed whole (seconds of the gateway's loop, for
    each call, each ending in a 400) before its line count was looked at."""
    many = b"\n".join(line(f"c{i}", "hi") for i in range(MAX_LINES + 1))
    with pytest.raises(ApiError, match=f"more than {MAX_LINES} lines"):
        input_lines(many + b"\nnot JSON, and never read\n", URL)


@pytest.mark.parametrize(
    ("age_h", "cancelled", "codes", "settled"),
    [
        (1, False, [200, 400, 200], True),  # completed
        (1, True, [200, None, None], True),  # cancelled, every line answered
        (1, False, [200, 200], False),  # in progress
        (1, True, [200], False),  # cancelling
        (25, True, [200], False),  # cancelled by its window: unrun lines answered later
        (25, False, [200, None, None], False),  # expired: running lines still counted
        (27, False, [200, None, None], True),  # expired long enough for them to end
        (27, False, [200, None], False),  # expired, not every line answered
    ],
)
def test_only_counts_no_answer_can_change_are_kept(
    age_h: int, cancelled: bool, codes: list[int | None], settled: bool
) -> None:
    """A batch's counts are kept on its row, and read from there from then on: kept too
    early, an answer that came later would never show; never kept (an expired batch),
    every read counted all its lines again."""
    assert is_settled(batch(dt.timedelta(hours=age_h), cancelled), Answered.of(codes)) is settled


def test_a_file_of_blank_lines_is_refused_without_a_line_object_each() -> None:
    """64 MiB of newlines was 64 million line objects (650 MB of the gateway's memory,
    3 s) before the file was found to have no lines; lines are found one at a time."""
    blank = b"\r\n \t\n" * (4 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(ApiError, match="no lines"):
            input_lines(blank, URL)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


def test_lines_are_numbered_as_the_file_is_split() -> None:
    ok = line("a", "x")
    with pytest.raises(ApiError, match="line 5 is not JSON"):
        input_lines(ok + b"\r\n\n \r" + line("b", "y") + b"\rnot json\n", URL)


def test_a_cancel_that_comes_after_the_last_answer_leaves_the_batch_completed() -> None:
    """A cancel reads the batch in progress, its last line is answered meanwhile, then the
    cancel is written: the batch was already shown completed and stays so. A cancel
    written before the last answer still cancels it."""
    cancelled = batch(dt.timedelta(hours=1), cancelled=True)
    assert cancelled.cancelled_at is not None
    at = cancelled.cancelled_at.replace(tzinfo=dt.UTC)
    before = batch_object(cancelled, Answered.of([200, 200, 400], at - dt.timedelta(seconds=1)))
    assert before["status"] == "completed"
    assert before["cancelled_at"] is None and before["cancelling_at"] is None
    assert before["output_file_id"] and before["error_file_id"]
    after = batch_object(cancelled, Answered.of([200, None, None], at + dt.timedelta(seconds=1)))
    assert after["status"] == "cancelled" and after["cancelled_at"] == int(at.timestamp())


def test_a_file_that_starts_with_a_byte_order_mark_is_read_as_without_it() -> None:
    """Windows tools (PowerShell 5's `Out-File -Encoding utf8`, Notepad) start a UTF-8
    file with a byte order mark: its first line is still JSON. A mark anywhere else is
    not."""
    first, second = line("a", "hi"), line("b", "there")
    assert input_lines(codecs.BOM_UTF8 + first + b"\r\n" + second, URL) == [first, second]
    with pytest.raises(ApiError, match="line 2 is not JSON"):
        input_lines(first + b"\n" + codecs.BOM_UTF8 + second, URL)


@pytest.mark.parametrize(
    ("age", "status"),
    [
        (dt.timedelta(seconds=5), "cancelling"),  # its lines may still be committed
        (dt.timedelta(minutes=5), "cancelled"),  # none ran: nothing to wait for
    ],
)
def test_a_batch_cancelled_while_queuing_shows_the_cancel(age: dt.timedelta, status: str) -> None:
    """Listed while its create is still queuing it, and cancelled: the cancel shows, not
    `validating` (nor `failed` once its gateway is known to have died)."""
    queuing = dataclasses.replace(batch(age, cancelled=True), queuing=True)
    shown = batch_object(queuing, Answered.of([]))
    assert shown["status"] == status
    assert shown["cancelling_at"] is not None and shown["errors"] is None
    assert (shown["cancelled_at"] is not None) == (status == "cancelled")


@pytest.mark.parametrize("method", ["GET", "post", None])
def test_a_line_not_posted_is_refused_with_the_file(method: str | None) -> None:
    """Checked at create, as OpenAI does: a file of "method": "GET" lines was taken,
    shown completed, with every line in the error file."""
    good = line("a", "hi")
    wrong = orjson.loads(line("b", "hi"))
    wrong["method"] = method
    with pytest.raises(ApiError, match="line 2: method must be POST") as error:
        input_lines(good + b"\n" + orjson.dumps(wrong) + b"\n", URL)
    assert error.value.status == 400
