"""`tandoor batch`'s client: a JSONL file of prompts through the OpenAI Batches API.

Each input line is `{"messages": [...]}` or `{"prompt": "..."}`, with optional
`max_tokens` and `temperature`; every line is checked before anything is sent. Submit
turns the file into OpenAI batch-input lines (custom_id `line-<n>`, n the line's number
in the file, as an editor counts), uploads it (`POST /v1/files`) and creates a batch
(`POST /v1/batches`); collect follows the batch (`GET /v1/batches/<id>`) and writes one
result per input line, in input order, from its input, output and error files. Nothing
here needs Kafka or Cassandra: only the gateway and a key.
"""

from __future__ import annotations

import asyncio
import codecs
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from producers.gateway.chat.protocol import CONTENT_MAX_CHARS
from producers.gateway.openai_api.protocol import ChatCompletionRequest, InputMessage
from schemas.events import MAX_REPLY_TOKENS, MAX_TEMPERATURE

Progress = Callable[[int, int], None]  # (done, total)
FINAL = {"completed", "cancelled", "expired", "failed"}
POLL_S = 1.0


class BatchLine(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # as the API takes its fields

    # The API's own message and request models: a line the gateway would refuse (a
    # message past its length, a key it does not take) is refused here, before upload.
    messages: list[InputMessage] | None = Field(default=None, min_length=1)
    prompt: str | None = Field(default=None, min_length=1, max_length=CONTENT_MAX_CHARS)
    max_tokens: int = Field(default=256, ge=1, le=MAX_REPLY_TOKENS)
    temperature: float = Field(default=0.0, ge=0.0, le=MAX_TEMPERATURE)

    @model_validator(mode="after")
    def _one_input(self) -> BatchLine:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give exactly one of 'messages' or 'prompt'")
        if self.chat()[-1].role != "user":  # as the gateway refuses it
            raise ValueError("the last message must be from the user")
        ChatCompletionRequest.model_validate(self.body("any"))  # as the gateway checks it
        return self

    def chat(self) -> list[InputMessage]:
        return self.messages or [InputMessage(role="user", content=self.prompt or "")]

    def body(self, model: str) -> dict[str, Any]:
        return {
            "model": model,
            "messages": [m.model_dump(exclude_none=True) for m in self.chat()],
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
        }

    def request(self, number: int, model: str) -> dict[str, Any]:
        """The line as OpenAI batch input."""
        body = self.body(model)
        return {"custom_id": f"line-{number}", "method": "POST", "url": CHAT, "body": body}


CHAT = "/v1/chat/completions"


class BatchError(Exception):
    """A problem the caller must fix: a bad line, an unknown batch, a refused request."""


def read_batch(path: Path) -> list[tuple[int, BatchLine]]:
    """The file's prompts with their line numbers (blank lines skipped), every one
    checked before anything is sent."""
    lines = []
    text = path.read_bytes().removeprefix(codecs.BOM_UTF8)  # not part of the first line
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            lines.append((number, BatchLine.model_validate(orjson.loads(raw))))
        except (orjson.JSONDecodeError, ValidationError) as exc:
            raise BatchError(f"{path}:{number}: {_first_error(exc)}") from exc
    if not lines:
        raise BatchError(f"{path}: no prompts")
    return lines


@dataclass(frozen=True)
class Collected:
    batch_id: str
    status: str
    lines: int
    answered: int
    failed: int

    @property
    def complete(self) -> bool:
        """Every line has its reply."""
        return self.answered == self.lines and not self.failed


class BatchClient:
    """The Batches API for one key, at `api_url` (e.g. http://127.0.0.1:8000/v1)."""

    def __init__(
        self, api_url: str, api_key: str, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self._http = httpx.AsyncClient(
            base_url=api_url.rstrip("/"),
            headers={"Authorization": f"Bearer {api_key}"},
            timeout=httpx.Timeout(300, connect=10),
            transport=transport,
        )

    async def __aenter__(self) -> BatchClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self._http.aclose()

    async def submit(self, path: Path, model: str, progress: Progress | None = None) -> str:
        lines = read_batch(path)
        content = b"".join(orjson.dumps(line.request(n, model)) + b"\n" for n, line in lines)
        files = {"file": (path.name, content, "application/jsonl")}
        uploaded = await self._call("POST", "/files", data={"purpose": "batch"}, files=files)
        if progress:
            progress(1, 2)
        body = {"input_file_id": uploaded["id"], "endpoint": CHAT, "completion_window": "24h"}
        try:
            batch = await self._call("POST", "/batches", json=body)
        except BatchError:  # refused (a quota, the queue cap): no file left behind
            await self._http.delete(f"/files/{uploaded['id']}")
            raise
        if progress:
            progress(2, 2)
        return str(batch["id"])

    async def collect(
        self, batch_id: str, out: Path, wait_s: float = 600, progress: Progress | None = None
    ) -> Collected:
        """Follow the batch until it ends, or until no line has been answered for
        `wait_s` (a batch that is progressing, however slowly, is waited for); then
        write `out` in input order, atomically: rerunning it only rewrites the file."""
        loop = asyncio.get_running_loop()
        answered, moved_at = -1, loop.time()
        while True:
            batch = await self._call("GET", f"/batches/{batch_id}")
            counts = batch["request_counts"]
            done = counts["completed"] + counts["failed"]
            if progress:
                progress(done, counts["total"])
            if done > answered:
                answered, moved_at = done, loop.time()
            if batch["status"] in FINAL or loop.time() - moved_at > wait_s:
                break
            await asyncio.sleep(POLL_S)
        outputs = await self._outputs(batch_id)
        missing = _unanswered_reason(batch)
        ids = [line["custom_id"] for line in await self._file(batch["input_file_id"])]
        results = [_result(n, cid, outputs.get(cid), missing) for n, cid in enumerate(ids, 1)]
        _write_atomically(out, results)
        failed = sum("error" in r for r, cid in zip(results, ids, strict=True) if cid in outputs)
        return Collected(batch_id, batch["status"], len(ids), len(outputs), failed)

    async def _outputs(self, batch_id: str) -> dict[str, dict[str, Any]]:
        """Every output line so far, by custom_id (the output and error files)."""
        found: dict[str, dict[str, Any]] = {}
        for prefix in ("file-out-", "file-err-"):
            found |= {line["custom_id"]: line for line in await self._file(prefix + batch_id)}
        return found

    async def _file(self, file_id: str) -> list[dict[str, Any]]:
        response = await self._http.get(f"/files/{file_id}/content")
        _raise_for(response)
        content = response.content.removeprefix(codecs.BOM_UTF8)  # an input file's, kept as sent
        return [orjson.loads(raw) for raw in content.splitlines() if raw.strip()]

    async def _call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        response = await self._http.request(method, path, **kwargs)
        _raise_for(response)
        result: dict[str, Any] = response.json()
        return result


def api_url_from_env(host: str, port: int) -> str:
    return os.environ.get("TANDOOR_API_URL") or f"http://{host}:{port}/v1"


def _raise_for(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:500]
    raise BatchError(f"{response.status_code}: {message}")


def _unanswered_reason(batch: dict[str, Any]) -> str:
    """What a line with no answer is told, as the batch stands."""
    status = batch["status"]
    if status not in FINAL:
        return "not answered yet: collect again later"
    if status == "failed":
        reasons = [e.get("message") for e in (batch.get("errors") or {}).get("data") or []]
        return "the batch failed: " + ("; ".join(r for r in reasons if r) or "no reason given")
    return f"the batch was {status} before this line ran"


def _result(
    position: int, custom_id: str, output: dict[str, Any] | None, missing: str
) -> dict[str, Any]:
    """`line`: the input file's line number (`line-<n>`, as submit names them), else the
    line's position among the batch's lines."""
    digits = custom_id.removeprefix("line-")
    number = int(digits) if digits != custom_id and _short_ascii_number(digits) else position
    if output is None:
        return {"line": number, "error": missing}
    response = output.get("response") or {}
    result: dict[str, Any] = {"line": number, "request_id": response.get("request_id")}
    body = response.get("body") or {}
    if response.get("status_code") == 200:
        choice = body["choices"][0]
        usage = body["usage"]
        result |= {
            "finish_reason": choice["finish_reason"],
            "text": choice["message"]["content"],
            "usage": {k: usage[k] for k in ("prompt_tokens", "completion_tokens")},
        }
    elif response:
        result["error"] = (body.get("error") or {}).get(
            "message"
        ) or f"HTTP {response['status_code']}"
    else:
        error = output.get("error") or {}
        result["error"] = error.get("message") or error.get("code") or "failed"
    return result


def _short_ascii_number(text: str) -> bool:
    return 0 < len(text) <= 9 and text.isascii() and text.isdigit()


def _write_atomically(out: Path, results: list[dict[str, Any]]) -> None:
    partial = out.with_name(f".{out.name}.partial")
    with partial.open("wb") as f:
        for result in results:
            f.write(orjson.dumps(result) + b"\n")
        f.flush()
        os.fsync(f.fileno())
    partial.replace(out)


def _first_error(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        return f"{where or 'line'}: {first.get('msg', 'invalid')}"
    return f"not JSON ({exc})"
