"""Property-based fuzzing of the whole HTTP API from its OpenAPI spec (schemathesis):
valid and invalid requests alike, with a real key; no request may get a 5xx."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from infra.process import free_port
from infra.roles import GatewayProcess, running, with_models
from tests.e2e.helpers import auth
from tests.e2e.stack import Stack
from tests.seeds import SEED, seed_note

pytestmark = pytest.mark.integration


async def test_the_fuzzer_finds_no_server_errors(stack: Stack, tmp_path: Path) -> None:
    # A replica serving only the model that has a worker: a model nobody serves would
    # rightly end in a 504, which is an outage, not a bug the fuzzer should report.
    env = {
        **with_models(stack.env, only=[stack.model]),
        "TANDOOR_FALLBACKS": "{}",
        "TANDOOR_GATEWAY_GROUP": f"gateway-fuzz-{uuid.uuid4().hex[:6]}",
    }
    gateway = GatewayProcess(stack.logs, free_port(), env)
    headers = await auth(stack, "fuzz")
    async with running([gateway]):
        result = await asyncio.to_thread(
            fuzz, f"http://127.0.0.1:{gateway.port}", headers, tmp_path
        )
    assert result.returncode == 0, f"{seed_note()}\n{result.stdout[-6000:]}"
    tested = re.search(r"Tested: (\d+)", result.stdout)
    assert tested and int(tested[1]) >= 10, result.stdout[-3000:]  # every operation ran


def fuzz(url: str, headers: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    ((name, value),) = headers.items()
    command = [
        str(Path(sys.executable).with_name("schemathesis")),
        "run",
        f"{url}/openapi.json",
        "--header",
        f"{name}: {value}",
        "--checks",
        "not_a_server_error",
        "--phases",
        "examples,coverage,fuzzing,stateful",
        "--max-examples",
        "15",
        "--seed",
        str(SEED),
        "--request-timeout",
        "60",
        "--no-color",
    ]
    return subprocess.run(
        command, cwd=cwd, capture_output=True, text=True, timeout=900, check=False
    )
