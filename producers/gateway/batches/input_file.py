"""A batch's input file read as its lines: blank lines skipped, each line checked as
far as the batch as a whole needs. What each request asks is checked by admission."""

from __future__ import annotations

import codecs
from collections.abc import Iterator

import orjson
import re2

from producers.gateway.errors import ApiError
from schemas.batch import MAX_CUSTOM_ID_CHARS, MAX_LINE_BYTES

MAX_LINES = 50_000
PARAM = "input_file_id"  # what a bad input file is reported against
NOT_BLANK = re2.compile(rb"[^\S\r\n]*\S[^\r\n]*")  # a line with more than white space


def _numbered_lines(content: bytes) -> Iterator[tuple[int, bytes]]:
    """The lines that are not blank, with their numbers (split as bytes.splitlines
    does), found one at a time in linear time: a file of 64 MiB of newlines was 64
    million line objects (650 MB, 3 s) before the cap on lines could say no. A byte
    order mark that starts the file (Windows tools write one) is not part of line 1."""
    number, start = 1, len(codecs.BOM_UTF8) if content.startswith(codecs.BOM_UTF8) else 0
    for found in NOT_BLANK.finditer(content, start):
        between = (start, found.start())
        number += content.count(b"\n", *between) + content.count(b"\r", *between)
        number -= content.count(b"\r\n", *between)
        start = found.start()
        yield number, found.group()


def input_lines(content: bytes, endpoint: str) -> list[bytes]:
    """The file's lines, each checked as far as the batch as a whole needs: JSON with a
    unique custom_id, for the batch's endpoint. What each request asks is checked by
    admission, which answers a bad one with an error line."""
    lines, seen = [], set()
    for number, raw in _numbered_lines(content):
        if len(raw) > MAX_LINE_BYTES:  # Kafka would refuse it half-way through the batch
            raise ApiError(
                400, f"line {number} is {len(raw)} bytes: at most {MAX_LINE_BYTES}", param=PARAM
            )
        try:
            line = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ApiError(400, f"line {number} is not JSON: {exc}", param=PARAM) from exc
        custom_id = line.get("custom_id") if isinstance(line, dict) else None
        if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID_CHARS:
            raise ApiError(400, f"line {number} has no valid custom_id", param=PARAM)
        if custom_id in seen:
            raise ApiError(
                400, f"line {number}: custom_id {custom_id!r} is used twice", param=PARAM
            )
        if line.get("url") != endpoint:
            raise ApiError(400, f"line {number}: url must be {endpoint}", param=PARAM)
        if line.get("method") != "POST":  # what admission would refuse in each line
            raise ApiError(400, f"line {number}: method must be POST", param=PARAM)
        seen.add(custom_id)
        lines.append(raw)
        if len(lines) > MAX_LINES:  # said before the rest is parsed
            raise ApiError(400, f"more than {MAX_LINES} lines", param=PARAM)
    if not lines:
        raise ApiError(400, "the input file has no lines", param=PARAM)
    return lines
