"""A tier's cap on enqueued batch lines, through the Batches API with admission,
persistence and the worker running: a user held back by its quota could create batches
without end, on every partition of `batch.requests`, and fill admission's buffer shares
while every other tenant's batches waited behind its lines."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from infra.process import free_port
from infra.roles import AdmissionProcess, GatewayProcess, PersistProcess, WorkerProcess, running
from tandoor.settings import Settings
from tests.integration.batch_lines import question, slow_tenant
from tests.waiting import eventually

pytestmark = pytest.mark.integration
CAP = 3


async def create(http: httpx.AsyncClient, model: str, lines: int, first: int = 0) -> httpx.Response:
    content = b"".join(question(model, first + i) + b"\n" for i in range(lines))
    files = {"file": ("in.jsonl", content)}
    uploaded = await http.post("/v1/files", files=files, data={"purpose": "batch"})
    assert uploaded.status_code == 200, uploaded.text
    body = {
        "input_file_id": uploaded.json()["id"],
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    }
    return await http.post("/v1/batches", json=body)


async def test_batches_past_a_tiers_enqueued_lines_wait_until_lines_are_answered(
    settings: Settings, worker: WorkerProcess, roles_env: dict[str, str], tmp_path: Path
) -> None:
    env, key, _ = await slow_tenant(settings, roles_env, max_enqueued_batch_lines=CAP)
    gateway = GatewayProcess(tmp_path, free_port(), env)
    roles = [AdmissionProcess(tmp_path, env), PersistProcess(tmp_path, env), gateway]
    async with running(roles):
        url, auth = f"http://127.0.0.1:{gateway.port}", {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(base_url=url, headers=auth, timeout=60) as http:
            too_big = await create(http, worker.model, CAP + 1)
            assert too_big.status_code == 400 and "split it" in too_big.text, too_big.text

            first = await create(http, worker.model, CAP)  # one line a minute runs
            assert first.status_code == 200, first.text

            # As many again: a 429 whether its first line was answered meanwhile or not.
            later = await create(http, worker.model, CAP, first=CAP)
            assert later.status_code == 429, later.text
            error = later.json()["error"]
            assert error["type"] == "rate_limit_error" and later.headers["Retry-After"]
            assert re.match(r"[23] lines of your batches are not answered yet", error["message"])
            assert error["code"] == "rate_limit_exceeded"

            listed = (await http.get("/v1/batches")).json()["data"]
            assert [b["id"] for b in listed] == [first.json()["id"]], "refused, not stored"

            batch_path = f"/v1/batches/{first.json()['id']}"
            assert (await http.post(f"{batch_path}/cancel")).status_code == 200

            async def shown() -> dict[str, Any]:
                found: dict[str, Any] = (await http.get(batch_path)).json()
                return {"status": found["status"], "counts": found["request_counts"]}

            # Its waiting lines answered `batch_cancelled` by admission, the one that
            # ran by persistence: none waits any more.
            await eventually(shown, lambda b: b["status"] == "cancelled", what="the cancel")
            again = await create(http, worker.model, 1, first=CAP)
            assert again.status_code == 200, again.text
