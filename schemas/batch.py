"""How a batch line is named in the pipeline: `<batch id>.<line number>`, so any
role can tell which line of which batch a prompt or a final event answers."""

from __future__ import annotations


def line_request_id(batch_id: str, line: int) -> str:
    return f"{batch_id}.{line}"


def line_of(request_id: str) -> int | None:
    _, sep, line = request_id.rpartition(".")
    return int(line) if sep and line.isdigit() else None
