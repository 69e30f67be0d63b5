"""The tail of a stream (`python -m consumers.tail`), as an analytics user runs it on a
live topic: a tombstone, or a record of another shape, is shown or passed over, never
the end of the tail (it raised TypeError on a tombstone, KeyError on a missing field,
and every rerun ended there again while the record was kept)."""

from __future__ import annotations

import subprocess
import sys

import orjson

from consumers.tail import line_of


def test_a_tombstone_is_passed_over() -> None:
    assert line_of("tokens", None) is None


def test_records_of_another_shape_are_shown_raw() -> None:
    deep = b"[" * 100_000  # json's parser ran out of stack: RecursionError, the tail's end
    for value in (b"\xff\xfe", b"[1, 2]", b'{"type": "token"}', b'"text"', b"{", deep):
        line = line_of("tokens", value)
        assert line is not None and line.startswith("(not a tokens event"), line


def test_a_token_event_is_described() -> None:
    event = {"type": "token", "request_id": "r1", "attempt": 1, "seq": 3, "delta": "Hi"}
    assert line_of("tokens", orjson.dumps(event)) == "r1#1.3 'Hi'"


def test_a_limit_below_one_is_refused_by_name() -> None:
    """--limit 0 printed one record: the limit was looked at after it."""
    argv = [sys.executable, "-m", "consumers.tail", "usage", "--limit", "0", "--bootstrap", "x"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2 and "--limit: must be 1 or more, not 0" in result.stderr
