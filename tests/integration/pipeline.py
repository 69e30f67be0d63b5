"""Test helpers around real worker processes and the real `tokens` topic."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
import uuid
from collections import defaultdict
from pathlib import Path

from aiokafka import AIOKafkaConsumer

from schemas import topics
from schemas.codec import decode_token_stream
from schemas.events import ChatMessage, FinalEvent, PromptRequest, Sampling, TokenEvent, now_ms
from tandoor.clients import assign_from_end
from tandoor.settings import Settings

READY_LINE = "worker for {model} ready"


class WorkerProcess:
    """`tandoor worker --model M` as a child process, the way operators run it."""

    def __init__(self, model: str, log_dir: Path, env: dict[str, str]) -> None:
        self.model = model
        self.log_file = log_dir / f"worker-{model}-{uuid.uuid4().hex[:6]}.log"
        self._env = {**os.environ, "TANDOOR_WORKER_METRICS_PORT": "0", **env}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log_file.open("wb") as log:
            self.proc = subprocess.Popen(
                ["tandoor", "worker", "--model", self.model],
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
            assert self.proc is not None and self.proc.poll() is None, (
                f"worker exited during start-up:\n{self.log()[-4000:]}"
            )
            await asyncio.sleep(0.5)
        raise AssertionError(f"worker not ready in {timeout_s} s:\n{self.log()[-4000:]}")

    def log(self) -> str:
        return self.log_file.read_text(errors="replace") if self.log_file.exists() else ""

    def metrics_port(self) -> int:
        for line in self.log().splitlines():
            if "/metrics" in line and "http://" in line:
                return int(line.rsplit(":", 1)[1].split("/")[0])
        raise AssertionError("worker never logged its metrics address")

    def kill(self) -> None:
        """kill -9 the whole process tree (vLLM's engine core runs in a child)."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def terminate(self, timeout_s: float = 120) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class TokenStream:
    """Reads `tokens` from now on and sorts events by request id."""

    def __init__(self, settings: Settings) -> None:
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=settings.kafka_bootstrap, group_id=None, fetch_max_wait_ms=5
        )
        self.events: dict[str, list[TokenEvent | FinalEvent]] = defaultdict(list)
        self.arrival: dict[str, float] = {}  # request id -> monotonic time of its final
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> TokenStream:
        await self._consumer.start()
        await assign_from_end(self._consumer, topics.TOKENS)
        self._task = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self._consumer.stop()

    async def _read(self) -> None:
        async for record in self._consumer:
            event = decode_token_stream(record.value)
            self.events[event.request_id].append(event)
            if isinstance(event, FinalEvent):
                self.arrival[event.request_id] = time.monotonic()

    def finals(self, request_id: str) -> list[FinalEvent]:
        return [e for e in self.events[request_id] if isinstance(e, FinalEvent)]

    def tokens(self, request_id: str, attempt: int) -> list[TokenEvent]:
        return [
            e for e in self.events[request_id] if isinstance(e, TokenEvent) and e.attempt == attempt
        ]

    async def final(self, request_id: str, timeout_s: float = 120) -> FinalEvent:
        await self.wait_for(lambda: bool(self.finals(request_id)), timeout_s, request_id)
        return self.finals(request_id)[-1]

    async def first_token(self, request_id: str, timeout_s: float = 120) -> TokenEvent:
        await self.wait_for(lambda: bool(self.tokens(request_id, 1)), timeout_s, request_id)
        return self.tokens(request_id, 1)[0]

    async def wait_for(self, condition: object, timeout_s: float, what: str) -> None:
        assert callable(condition)
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
            await asyncio.sleep(0.02)


def prompt(
    model: str,
    text: str,
    *,
    band: str = "interactive-paid",
    max_tokens: int = 32,
    deadline_ms: int | None = None,
    conversation_id: str | None = None,
) -> PromptRequest:
    return PromptRequest(
        request_id=f"req-{uuid.uuid4().hex[:12]}",
        model=model,
        user_id="tester",
        tier="plus",
        band=band,
        conversation_id=conversation_id or f"conv-{uuid.uuid4().hex[:8]}",
        messages=[ChatMessage(role="user", content=text)],
        sampling=Sampling(max_tokens=max_tokens, temperature=0.0),
        created_at_ms=now_ms(),
        deadline_ms=deadline_ms,
    )
