"""Tandoor's own roles as child processes (a worker today), started and stopped the way
an operator would: for the local main job, the tests and the benchmarks."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from infra.errors import StartError

READY_LINE = "worker for {model} ready"


class WorkerProcess:
    """`tandoor worker --model M` as a child process: for the main job, tests and benchmarks."""

    def __init__(self, model: str, log_dir: Path, env: dict[str, str]) -> None:
        self.model = model
        self.log_file = log_dir / f"worker-{model}-{uuid.uuid4().hex[:6]}.log"
        self._env = {**os.environ, "TANDOOR_WORKER_METRICS_PORT": "0", **env}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log_file.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tandoor", "worker", "--model", self.model],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._env,
                start_new_session=True,
            )

    async def wait_ready(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if READY_LINE.format(model=self.model) in self.log():
                return
            if self.proc is None or self.proc.poll() is not None:
                raise StartError(f"worker exited during start-up:\n{self.log()[-4000:]}")
            await asyncio.sleep(0.5)
        raise StartError(f"worker not ready in {timeout_s} s:\n{self.log()[-4000:]}")

    def log(self) -> str:
        return self.log_file.read_text(errors="replace") if self.log_file.exists() else ""

    def metrics_port(self) -> int:
        for line in self.log().splitlines():
            if "/metrics" in line and "http://" in line:
                return int(line.rsplit(":", 1)[1].split("/")[0])
        raise RuntimeError("worker never logged its metrics address")

    def kill(self) -> None:
        """kill -9 the whole process tree (vLLM's engine core runs in a child)."""
        if self.proc is None:
            return
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def terminate(self, timeout_s: float = 120) -> int:
        """SIGTERM and wait for the exit code (SIGKILL if it does not come in time)."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
