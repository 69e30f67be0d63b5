"""Batch jobs: a JSONL file of prompts through the same pipeline, in the batch band.

Each input line is `{"messages": [...]}` or `{"prompt": "..."}`, with optional
`max_tokens` and `temperature`. A batch's id comes from its owner, model and file
content, so submitting the same file again resumes it: how far submission got is
kept in Cassandra, and each line's request id is `<batch id>.<line>`, so a line is
never queued twice. The persistence consumer files each answer under its line;
collecting reads them back in input order.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from producers.prompts import PromptSubmitter
from schemas.batch import line_request_id
from schemas.events import (
    ANSWERED,
    MAX_REPLY_TOKENS,
    MAX_TEMPERATURE,
    ChatMessage,
    PromptRequest,
    Sampling,
    now_ms,
)
from tandoor.clients import cassandra_session, cql, kafka_producer, redis_client
from tandoor.policies.api_keys import Principal
from tandoor.policies.context import count_tokens
from tandoor.policies.quota import QuotaExceeded, Quotas
from tandoor.settings import Settings

BATCH_BAND = "batch"
CHUNK = 64  # lines produced together, then recorded as submitted
Progress = Callable[[int, int], None]  # (done, total)


class BatchLine(BaseModel):
    model_config = ConfigDict(extra="forbid")

    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    prompt: str | None = Field(default=None, min_length=1)
    max_tokens: int = Field(default=256, ge=1, le=MAX_REPLY_TOKENS)
    temperature: float = Field(default=0.0, ge=0.0, le=MAX_TEMPERATURE)

    @model_validator(mode="after")
    def _one_input(self) -> BatchLine:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give exactly one of 'messages' or 'prompt'")
        return self

    def chat(self) -> list[ChatMessage]:
        return self.messages or [ChatMessage(role="user", content=self.prompt or "")]


class BatchError(Exception):
    """A problem the caller must fix: a bad line, an unknown batch, someone else's."""


def read_batch(path: Path) -> tuple[bytes, list[BatchLine]]:
    """The file's bytes and its lines, every one checked before anything is sent."""
    content = path.read_bytes()
    lines = []
    for number, raw in enumerate(content.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            lines.append(BatchLine.model_validate(orjson.loads(raw)))
        except (orjson.JSONDecodeError, ValidationError) as exc:
            raise BatchError(f"{path}:{number}: {_first_error(exc)}") from exc
    if not lines:
        raise BatchError(f"{path}: no prompts")
    return content, lines


def batch_id_for(user_id: str, model: str, content: bytes) -> str:
    digest = hashlib.sha256(b"\0".join([user_id.encode(), model.encode(), content]))
    return f"b_{digest.hexdigest()[:24]}"


@dataclass(frozen=True)
class Collected:
    batch_id: str
    lines: int
    answered: int
    failed: int


class BatchClient:
    """The Python API behind `tandoor batch submit|collect`, for one caller."""

    def __init__(self, settings: Settings, caller: Principal) -> None:
        self.settings = settings
        self.caller = caller

    async def submit(self, path: Path, model: str, progress: Progress | None = None) -> str:
        if model not in self.settings.models:
            served = self.settings.served_models
            raise BatchError(f"model {model!r} is not served; models: {served}")
        content, lines = read_batch(path)
        batch_id = batch_id_for(self.caller.user_id, model, content)
        async with self._connections() as (session, submitter, quotas):
            done = await self._register(session, batch_id, model, len(lines))
            for start in range(done, len(lines), CHUNK):
                chunk = range(start, min(start + CHUNK, len(lines)))
                await asyncio.gather(
                    *(self._send(submitter, quotas, batch_id, model, n, lines[n]) for n in chunk)
                )
                await cql(
                    session,
                    "UPDATE batches SET submitted = %s WHERE batch_id = %s",
                    (chunk.stop, batch_id),
                )
                if progress:
                    progress(chunk.stop, len(lines))
        return batch_id

    async def collect(
        self, batch_id: str, out: Path, wait_s: float = 600, progress: Progress | None = None
    ) -> Collected:
        """Wait until every line is answered, or until none has been answered for
        `wait_s` (a batch that is progressing, however slowly, is waited for); then write
        `out` in input order, atomically: rerunning it only rewrites the same file."""
        loop = asyncio.get_running_loop()
        async with self._connections() as (session, _, _):
            total = await self._owned_lines(session, batch_id)
            answered, last_answer = -1, loop.time()
            while True:
                rows = {r.line: r for r in await cql(session, SELECT_RESULTS, (batch_id,))}
                if progress:
                    progress(len(rows), total)
                if len(rows) > answered:
                    answered, last_answer = len(rows), loop.time()
                if len(rows) >= total or loop.time() - last_answer > wait_s:
                    break
                await asyncio.sleep(1)
        _write_atomically(out, [_result_line(n, rows.get(n)) for n in range(total)])
        failed = sum(1 for r in rows.values() if r.finish_reason not in ANSWERED)
        return Collected(batch_id, total, len(rows), failed + total - len(rows))

    async def _send(
        self,
        submitter: PromptSubmitter,
        quotas: Quotas,
        batch_id: str,
        model: str,
        number: int,
        line: BatchLine,
    ) -> None:
        request_id = line_request_id(batch_id, number)
        policy = self.settings.tiers[self.caller.tier]
        estimate = sum(count_tokens(m.content) + 6 for m in line.chat()) + line.max_tokens
        while True:  # charged to the caller's quota; over it, wait as told
            admitted_at = now_ms()
            try:
                await quotas.admit(
                    self.caller.user_id, policy, request_id, estimate, admitted_at, False
                )
                break
            except QuotaExceeded as exc:
                await asyncio.sleep(exc.retry_after_s)
        await submitter.submit(
            PromptRequest(
                request_id=request_id,
                model=model,
                user_id=self.caller.user_id,
                tier=self.caller.tier,
                band=BATCH_BAND,
                conversation_id=request_id,  # spreads the lines over the band's partitions
                messages=line.chat(),
                sampling=Sampling(max_tokens=line.max_tokens, temperature=line.temperature),
                created_at_ms=admitted_at,  # the minute its quota was charged in
                kind="batch",
                batch_id=batch_id,
                prompt_tokens_estimate=estimate - line.max_tokens,
                charged_tokens=estimate,
            )
        )

    async def _register(self, session: Any, batch_id: str, model: str, lines: int) -> int:
        """The batch's row (made once) and how many lines were already submitted."""
        rows = await cql(
            session, "SELECT user_id, submitted FROM batches WHERE batch_id = %s", (batch_id,)
        )
        if rows:
            return int(rows[0].submitted or 0)
        await cql(
            session,
            "INSERT INTO batches (batch_id, user_id, model, lines, submitted, created_at) "
            "VALUES (%s, %s, %s, %s, 0, %s) IF NOT EXISTS",
            (batch_id, self.caller.user_id, model, lines, dt.datetime.now(dt.UTC)),
        )
        return 0

    async def _owned_lines(self, session: Any, batch_id: str) -> int:
        rows = await cql(
            session, "SELECT user_id, lines FROM batches WHERE batch_id = %s", (batch_id,)
        )
        if not rows or rows[0].user_id != self.caller.user_id:
            raise BatchError(f"batch {batch_id} not found")  # someone else's looks the same
        return int(rows[0].lines)

    @asynccontextmanager
    async def _connections(self) -> AsyncIterator[tuple[Any, PromptSubmitter, Quotas]]:
        cache = redis_client(self.settings)
        try:
            with cassandra_session(self.settings, self.settings.keyspace) as session:
                async with kafka_producer(self.settings, "batch") as producer:
                    yield session, PromptSubmitter(self.settings, producer), Quotas(cache)
        finally:
            await cache.aclose()


SELECT_RESULTS = (
    "SELECT line, request_id, finish_reason, error, text, prompt_tokens, completion_tokens "
    "FROM batch_results WHERE batch_id = %s"
)


def _result_line(number: int, row: Any) -> dict[str, Any]:
    if row is None:
        return {"line": number, "error": "not answered yet: collect again later"}
    result: dict[str, Any] = {
        "line": number,
        "request_id": row.request_id,
        "finish_reason": row.finish_reason,
        "text": row.text,
        "usage": {"prompt_tokens": row.prompt_tokens, "completion_tokens": row.completion_tokens},
    }
    if row.finish_reason not in ANSWERED:
        result["error"] = row.error or row.finish_reason
    return result


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
