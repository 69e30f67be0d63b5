"""`tandoor batch`'s client against a stand-in of the Batches API (the real one runs in
tests/e2e/test_batches.py): what a user reads in the results file and the exit status
when a batch ends without answering every line, and what a refused create leaves."""

from __future__ import annotations

import codecs
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from producers.batch import BatchClient, BatchError


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(row) + b"\n" for row in rows)


def answer(custom_id: str, text: str) -> dict[str, Any]:
    body = {
        "choices": [{"finish_reason": "stop", "message": {"content": text}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
    }
    response = {"status_code": 200, "request_id": f"r-{custom_id}", "body": body}
    return {"custom_id": custom_id, "response": response, "error": None}


class BatchesStandIn:
    """The routes `tandoor batch` calls, with one batch in a given state."""

    def __init__(self, batch: dict[str, Any], inputs: list[str], out: list[dict[str, Any]]):
        self.batch = {"id": "batch_1", "input_file_id": "file-in", **batch}
        self.files = {"file-in": jsonl([{"custom_id": c} for c in inputs])}
        self.files["file-out-batch_1"] = jsonl(out)
        self.files["file-err-batch_1"] = b""
        self.deleted: list[str] = []
        self.refuse_create = False

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path, method = request.url.path.removeprefix("/v1"), request.method
        if method == "GET" and path == "/batches/batch_1":
            return httpx.Response(200, json=self.batch)
        if method == "GET" and path.endswith("/content"):
            return httpx.Response(200, content=self.files[path.split("/")[2]])
        if method == "POST" and path == "/files":
            self.files["file-up"] = b""
            return httpx.Response(200, json={"id": "file-up"})
        if method == "POST" and path == "/batches" and self.refuse_create:
            error = {"message": "too many lines waiting", "code": "rate_limit_exceeded"}
            return httpx.Response(429, json={"error": error})
        if method == "DELETE" and path.startswith("/files/"):
            self.deleted.append(path.split("/")[2])
            return httpx.Response(200, json={"deleted": True})
        return httpx.Response(404, json={"error": {"message": f"no route {method} {path}"}})


def client(api: BatchesStandIn) -> BatchClient:
    return BatchClient("http://gateway/v1", "tdr_x", transport=httpx.MockTransport(api))


def counts(total: int, completed: int, failed: int = 0) -> dict[str, int]:
    return {"total": total, "completed": completed, "failed": failed}


async def test_a_failed_batchs_lines_say_it_failed_and_why(tmp_path: Path) -> None:
    reason = "the gateway stopped while queuing this batch: none of its lines ran"
    batch = {
        "status": "failed",
        "request_counts": counts(2, 0),
        "errors": {"data": [{"code": "queuing_interrupted", "message": reason}]},
    }
    api = BatchesStandIn(batch, ["line-1", "line-2"], [])
    async with client(api) as c:
        done = await c.collect("batch_1", tmp_path / "out.jsonl")
    rows = [orjson.loads(r) for r in (tmp_path / "out.jsonl").read_bytes().splitlines()]
    assert [r["line"] for r in rows] == [1, 2]
    assert all(r["error"] == f"the batch failed: {reason}" for r in rows), rows
    assert (done.status, done.answered, done.complete) == ("failed", 0, False)


async def test_lines_are_numbered_as_in_the_file_and_unrun_ones_say_the_batch_ended(
    tmp_path: Path,
) -> None:
    batch = {"status": "cancelled", "request_counts": counts(3, 1)}
    api = BatchesStandIn(batch, ["line-2", "line-4", "line-5"], [answer("line-4", "Hi")])
    async with client(api) as c:
        done = await c.collect("batch_1", tmp_path / "out.jsonl")
    rows = [orjson.loads(r) for r in (tmp_path / "out.jsonl").read_bytes().splitlines()]
    assert [(r["line"], r.get("text"), r.get("error")) for r in rows] == [
        (2, None, "the batch was cancelled before this line ran"),
        (4, "Hi", None),
        (5, None, "the batch was cancelled before this line ran"),
    ]
    assert (done.lines, done.answered, done.failed, done.complete) == (3, 1, 0, False)


async def test_another_clients_custom_ids_are_numbered_by_position(tmp_path: Path) -> None:
    batch = {"status": "completed", "request_counts": counts(2, 2)}
    out = [answer("q-b", "B"), answer("q-a", "A")]
    api = BatchesStandIn(batch, ["q-a", "q-b"], out)
    async with client(api) as c:
        done = await c.collect("batch_1", tmp_path / "out.jsonl")
    rows = [orjson.loads(r) for r in (tmp_path / "out.jsonl").read_bytes().splitlines()]
    assert [(r["line"], r["text"]) for r in rows] == [(1, "A"), (2, "B")]
    assert done.complete


async def test_an_input_file_that_starts_with_a_byte_order_mark_is_collected(
    tmp_path: Path,
) -> None:
    """The Batches API takes a file saved with a BOM (as Windows editors save UTF-8) and
    keeps it as sent: collect read its first line as JSON and ended in a traceback."""
    batch = {"status": "completed", "request_counts": counts(2, 2)}
    api = BatchesStandIn(batch, ["q-a", "q-b"], [answer("q-a", "A"), answer("q-b", "B")])
    api.files["file-in"] = codecs.BOM_UTF8 + api.files["file-in"].replace(b"\n", b"\r\n")
    async with client(api) as c:
        done = await c.collect("batch_1", tmp_path / "out.jsonl")
    rows = [orjson.loads(r) for r in (tmp_path / "out.jsonl").read_bytes().splitlines()]
    assert [(r["line"], r["text"]) for r in rows] == [(1, "A"), (2, "B")]
    assert done.complete


async def test_a_refused_create_deletes_the_file_it_uploaded(tmp_path: Path) -> None:
    prompts = tmp_path / "in.jsonl"
    prompts.write_bytes(jsonl([{"prompt": "Hi"}]))
    api = BatchesStandIn({"status": "validating", "request_counts": counts(1, 0)}, [], [])
    api.refuse_create = True
    async with client(api) as c:
        with pytest.raises(BatchError, match="429: too many lines waiting"):
            await c.submit(prompts, "smollm2")
    assert api.deleted == ["file-up"]
