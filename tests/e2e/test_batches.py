"""OpenAI's Files and Batches API on the real stack (gateway, admission, worker,
persist): the official client, unchanged, runs a 200-line batch; moderation and output
redaction apply as on every other surface; `tandoor batch` is a client of the same API;
a batch can be cancelled; bad files and other people's batches are refused; each user
lists only their own files."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest

from producers.batch_topic import chat_line
from tandoor.policies.api_keys import create_key
from tests.e2e.stack import BLOCKED_TERM, Stack
from tests.waiting import eventually

pytestmark = pytest.mark.integration

LINES = 200
EMAIL = re.compile(r"[\w.+-]+@[\w-]+\.[\w.-]+")
ASKED = "List three example email addresses of staff at example.com, one per line."


async def client_for(stack: Stack, tier: str = "batch") -> openai.AsyncOpenAI:
    key, _ = await create_key(stack.settings, f"batcher-{uuid.uuid4().hex[:6]}", tier)
    return openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key=key, max_retries=0)


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(line) + b"\n" for line in lines)


def question(
    stack: Stack, i: int, content: str | None = None, max_tokens: int = 4
) -> dict[str, Any]:
    body = {
        "model": stack.model,
        "messages": [
            {"role": "user", "content": content or f"What is {i} + {i}? Reply with the number."}
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    return chat_line(f"q{i}", body)


async def finished(client: openai.AsyncOpenAI, batch_id: str) -> Any:
    """The batch once it has ended, waiting while its lines keep being answered."""

    async def look() -> Any:  # each new count is progress
        return await client.batches.retrieve(batch_id)

    return await eventually(look, lambda b: b.status in ("completed", "cancelled"), what=batch_id)


async def lines_of(client: openai.AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    content = await client.files.content(file_id)
    return [orjson.loads(line) for line in content.content.splitlines()]


async def test_the_openai_client_runs_a_200_line_batch(stack: Stack) -> None:
    client = await client_for(stack)
    lines = [question(stack, i) for i in range(LINES)]
    lines.append(question(stack, LINES, f"Tell me about {BLOCKED_TERM}."))  # moderation
    lines.append(question(stack, LINES + 1, ASKED, max_tokens=48))  # output redaction
    async with client:
        uploaded = await client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        assert (await client.files.retrieve(uploaded.id)).bytes == len(jsonl(lines))
        created = await client.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata={"team": "e2e"},
        )
        assert created.status == "in_progress" and created.request_counts is not None
        assert created.request_counts.total == LINES + 2
        batch = await finished(client, created.id)
        assert batch.status == "completed", batch
        counts = batch.request_counts
        assert (counts.total, counts.completed, counts.failed) == (LINES + 2, LINES + 1, 1)
        outputs = await lines_of(client, batch.output_file_id)
        errors = await lines_of(client, batch.error_file_id)
        listed = [b.id for b in (await client.batches.list(limit=5)).data]
    assert created.id in listed and batch.metadata == {"team": "e2e"}

    by_id = {line["custom_id"]: line for line in outputs}
    assert len(by_id) == len(outputs) == LINES + 1, "a line answered twice"
    texts = {c: o["response"]["body"]["choices"][0]["message"]["content"] for c, o in by_id.items()}
    # Each answer is to its own line: it repeats the line's number or gives the sum.
    right = sum(str(i) in texts[f"q{i}"] or str(2 * i) in texts[f"q{i}"] for i in range(LINES))
    assert right > LINES // 2, f"only {right} answers match their line"
    assert "[email]" in texts[f"q{LINES + 1}"] and not EMAIL.search(texts[f"q{LINES + 1}"])
    (refused,) = errors
    assert refused["custom_id"] == f"q{LINES}"
    assert refused["response"]["status_code"] == 400
    assert refused["response"]["body"]["error"]["type"] == "moderation_error"


async def test_tandoor_batch_is_a_client_of_the_api(stack: Stack, tmp_path: Path) -> None:
    key, _ = await create_key(stack.settings, f"cli-{uuid.uuid4().hex[:6]}", "batch")
    prompts, results = tmp_path / "prompts.jsonl", tmp_path / "results.jsonl"
    rows = [{"prompt": f"What is {i} + {i}?", "max_tokens": 6} for i in range(12)]
    rows[5] = {"messages": [{"role": "user", "content": "word " * 4000}], "max_tokens": 6}
    # A blank line after the third: results are numbered as the file's lines are.
    prompts.write_bytes(jsonl(rows[:3]) + b"\n" + jsonl(rows[3:]))
    env = {**os.environ, "TANDOOR_API_URL": f"{stack.url}/v1", "TANDOOR_API_KEY": key}
    submitted = await run_cli(env, "submit", str(prompts), "--model", stack.model)
    batch_id = submitted.stdout.strip()  # the id alone: ID=$(tandoor batch submit ...)
    assert batch_id.startswith("batch_") and "\n" not in batch_id, submitted.stdout
    collected = await run_cli(env, "collect", batch_id, str(results), check=False)
    assert collected.returncode == 3, "a line failed: not every line has its reply"
    assert "12 of 12 lines answered, 1 failed (batch completed)" in collected.stdout
    out = [orjson.loads(line) for line in results.read_bytes().splitlines()]
    assert [r["line"] for r in out] == [1, 2, 3, *range(5, 14)]
    assert "context" in out[5]["error"]
    assert all(
        r["text"] and r["usage"]["completion_tokens"] >= 1 for i, r in enumerate(out) if i != 5
    )
    wrong = await run_cli(
        {**env, "TANDOOR_API_KEY": "tdr_wrong"}, "collect", batch_id, str(results), check=False
    )
    assert wrong.returncode == 2 and "401" in wrong.stderr


async def test_a_cancelled_batch_runs_no_more_lines(stack: Stack) -> None:
    client = await client_for(stack)
    lines = [question(stack, i, max_tokens=24) for i in range(60)]
    async with client:
        uploaded = await client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        created = await client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        cancelling = await client.batches.cancel(created.id)
        assert cancelling.status in ("cancelling", "cancelled")
        batch = await finished(client, created.id)
        errors = await lines_of(client, batch.error_file_id)
    counts = batch.request_counts
    assert batch.status == "cancelled" and counts.completed + counts.failed == 60
    cancelled = [e for e in errors if (e["error"] or {}).get("code") == "batch_cancelled"]
    assert len(cancelled) == counts.failed > 60 // 2, counts  # most never reached the band


async def test_bad_files_and_other_peoples_batches_are_refused(stack: Stack) -> None:
    owner, stranger = await client_for(stack), await client_for(stack)
    good = jsonl([question(stack, 1)])
    async with owner, stranger:
        with pytest.raises(openai.BadRequestError, match="purpose"):
            await owner.files.create(file=("in.jsonl", good), purpose="fine-tune")
        with pytest.raises(openai.BadRequestError, match="expires_after is not supported"):
            await owner.files.create(
                file=("in.jsonl", good),
                purpose="batch",
                expires_after={"anchor": "created_at", "seconds": 3600},
            )
        for content, problem in (
            (good + b"{not json\n", "line 2 is not JSON"),
            (good + good, "used twice"),
            (jsonl([{**question(stack, 1), "url": "/v1/embeddings"}]), "url must be"),
            (b"\n\n", "no lines"),
        ):
            bad = await owner.files.create(file=("bad.jsonl", content), purpose="batch")
            with pytest.raises(openai.BadRequestError, match=problem):
                await owner.batches.create(
                    input_file_id=bad.id, endpoint="/v1/chat/completions", completion_window="24h"
                )
        uploaded = await owner.files.create(file=("in.jsonl", good), purpose="batch")
        with pytest.raises(openai.NotFoundError):
            await stranger.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
        with pytest.raises(openai.NotFoundError):
            await stranger.files.content(uploaded.id)
        batch = await owner.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        for call in (stranger.batches.retrieve, stranger.batches.cancel):
            with pytest.raises(openai.NotFoundError):
                await call(batch.id)
        with pytest.raises(openai.NotFoundError):
            await stranger.files.content(f"file-out-{batch.id}")
        await finished(owner, batch.id)
        with pytest.raises(openai.ConflictError) as ended:  # the SDK asks it once only
            await owner.batches.cancel(batch.id)
        assert ended.value.response.headers.get("x-should-retry") == "false"


async def test_the_openai_client_lists_the_callers_own_files_page_by_page(stack: Stack) -> None:
    owner, stranger = await client_for(stack), await client_for(stack)
    async with owner, stranger:
        uploaded = [
            await owner.files.create(
                file=(f"in-{i}.jsonl", jsonl([question(stack, i)])), purpose="batch"
            )
            for i in range(5)
        ]
        theirs = await stranger.files.create(
            file=("x.jsonl", jsonl([question(stack, 9)])), purpose="batch"
        )
        newest_first = [f.id for f in reversed(uploaded)]
        # The client follows `after` from page to page by itself.
        assert [f.id async for f in owner.files.list(limit=2)] == newest_first
        assert [f.id async for f in owner.files.list(limit=2, order="asc")] == newest_first[::-1]
        page = await owner.files.list(limit=2)
        assert ([f.id for f in page.data], page.has_more) == (newest_first[:2], True)
        shown = {(f.filename, f.bytes, f.purpose) for f in page.data}
        assert shown == {(f.filename, f.bytes, "batch") for f in uploaded[-2:]}
        await owner.files.delete(uploaded[0].id)
        assert [f.id async for f in owner.files.list()] == newest_first[:-1]
        assert [f.id async for f in owner.files.list(purpose="fine-tune")] == []
        assert [f.id async for f in stranger.files.list()] == [theirs.id]
        with pytest.raises(openai.NotFoundError):  # another user's file is no cursor
            await owner.files.list(after=theirs.id)


async def run_cli(
    env: dict[str, str], *args: str, check: bool = True
) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "tandoor", "batch", *args]
    done = await asyncio.to_thread(
        subprocess.run, argv, env=env, capture_output=True, text=True, timeout=900, check=False
    )
    if check:
        assert done.returncode == 0, (done.stdout, done.stderr)
    return done
