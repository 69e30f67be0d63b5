"""Tandoor's own roles as child processes, started and stopped the way an operator
would: for the local main job, the tests and the benchmarks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Sequence, Set
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path

from infra.errors import StartError
from infra.idle_worker import READY as IDLE_READY
from infra.topics import TopicSpec, batch_request_partitions, ensure_topics, start_group_at_end
from schemas.topics import prompts_topic
from tandoor.settings import Settings

log = logging.getLogger(__name__)

# The longest silence of a start-up is an import of torch and vLLM (tens of seconds; a
# worker's engine does it in three processes, one after the other).
START_IDLE_S = 300.0


ROLE_LOGS_KEPT = 3  # of each role, the main job's earlier runs' logs kept beside its own


def prune_role_logs(
    roles: Sequence[RoleProcess], running: Set[str] = frozenset(), keep: int = ROLE_LOGS_KEPT
) -> list[Path]:
    """Remove all but the newest `keep` earlier logs of each role, none of a role still
    `running` (by log stem): every run of the main job writes new ones, `<role>-<id>.log`,
    and none was ever removed. The files removed."""
    removed: list[Path] = []
    for role in roles:
        pattern = re.compile(rf"{re.escape(role.name)}-[0-9a-f]{{6}}\.log")
        earlier = [
            (modified, path)
            for path in role.log_file.parent.glob(f"{role.name}-*.log")
            if pattern.fullmatch(path.name) and path != role.log_file
            if (modified := _modified(path)) is not None
        ]
        earlier.sort(reverse=True)
        for _, path in earlier[keep:]:
            if path.stem not in running:
                path.unlink(missing_ok=True)
                removed.append(path)
    return removed


def _modified(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:  # removed meanwhile (another run pruning)
        return None


class RoleProcess:
    """`tandoor <role> ...` as a child process, ready once its log shows `ready_line`."""

    module = "tandoor"  # what `python -m` runs

    def __init__(
        self, name: str, args: list[str], ready_line: str, log_dir: Path, env: dict[str, str]
    ) -> None:
        self.name = name
        self.args = args
        self.ready_line = ready_line
        self.log_file = log_dir / f"{name}-{uuid.uuid4().hex[:6]}.log"
        self._env = {**os.environ, **env}
        self.proc: subprocess.Popen[bytes] | None = None
        self._group_killed = False

    @property
    def env(self) -> dict[str, str]:
        """The environment it runs with: its settings, for a command run beside it."""
        return dict(self._env)

    def start(self) -> None:
        self._group_killed = False
        with self.log_file.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", self.module, *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._env,
                start_new_session=True,
            )

    async def wait_ready(self, idle_s: float = START_IDLE_S) -> None:
        """Until its log shows `ready_line`. Gives up when it exits, or when its log has
        not grown for `idle_s`: a start that is slow but moving (vLLM on a busy CPU
        takes minutes) is waited for, a stalled one is not."""
        loop = asyncio.get_running_loop()
        size, grew_at = -1, loop.time()
        while self.ready_line not in self.log():
            if self.proc is None or self.proc.poll() is not None:
                raise StartError(
                    f"{self.name} exited during start-up (log {self.log_file}):\n"
                    f"{self.log()[-4000:]}"
                )
            if self.log_size() != size:
                size, grew_at = self.log_size(), loop.time()
            elif loop.time() - grew_at > idle_s:
                raise StartError(
                    f"{self.name} not ready, its log silent for {idle_s:.0f} s "
                    f"(log {self.log_file}):\n"
                    f"{self.log()[-4000:]}"
                )
            await asyncio.sleep(0.25)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def log(self) -> str:
        return self.log_file.read_text(errors="replace") if self.log_file.exists() else ""

    def log_size(self) -> int:
        return self.log_file.stat().st_size if self.log_file.exists() else 0

    def ops_port(self) -> int:
        """The port of its /metrics, /health and /ready, as its log announced it."""
        return int(self._ops_address().group(2))

    def ops_url(self) -> str:
        """Its /metrics URL, as its log announced it (on the host it was told to bind)."""
        return self._ops_address().group(1)

    def _ops_address(self) -> re.Match[str]:
        found = OPS_ADDRESS.search(self.log())
        if found is None:
            raise RuntimeError(f"{self.name} never logged its metrics address")
        return found

    def kill(self) -> None:
        """kill -9 the whole process tree (a worker's vLLM engine core is a child)."""
        if self.proc is None:
            return
        self._kill_group()
        self.proc.wait(timeout=30)

    def terminate(self, timeout_s: float = 120) -> int:
        """SIGTERM and wait for the exit code (SIGKILL if it does not come in time)."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:  # killed: the teardown after it goes on
            log.warning(
                "%s did not stop in %.0f s: killed (log %s)", self.name, timeout_s, self.log_file
            )
            return self._kill_tree()
        finally:  # interrupted (a second Ctrl-C): nothing left running either
            if self.proc.poll() is None:
                self._kill_tree()
            # Its main process gone (it died first: kill -9, the OOM killer), what it
            # started runs on in its group: a worker's engine core watches no parent.
            self._kill_group()

    def _kill_tree(self) -> int:
        assert self.proc is not None
        self._kill_group()
        return self.proc.wait()

    def _kill_group(self) -> None:
        """SIGKILL the role's process group, once per start: killed again long after, the
        group's number may have gone to another process."""
        assert self.proc is not None
        if self._group_killed:
            return
        self._group_killed = True
        with contextlib.suppress(ProcessLookupError, PermissionError):  # gone (or not ours)
            os.killpg(self.proc.pid, signal.SIGKILL)


# Any host the role was told to bind (a name too: a dotted address alone was read, and
# `tandoor run` with TANDOOR_HOST=localhost failed once every role had started).
OPS_ADDRESS = re.compile(r"metrics on (http://[^\s/]+:(\d+)/metrics)")


class WorkerProcess(RoleProcess):
    """`tandoor worker --model M`; its ops port is picked free and logged."""

    def __init__(self, model: str, log_dir: Path, env: dict[str, str]) -> None:
        env = {"TANDOOR_WORKER_METRICS_PORT": "0", **env}
        ready = f"worker for {model} ready"
        super().__init__(f"worker-{model}", ["worker", "--model", model], ready, log_dir, env)
        self.model = model


class PersistProcess(RoleProcess):
    """`tandoor persist`."""

    def __init__(self, log_dir: Path, env: dict[str, str]) -> None:
        env = {"TANDOOR_PERSIST_METRICS_PORT": "0", **env}
        super().__init__("persist", ["persist"], "persist ready", log_dir, env)


class AdmissionProcess(RoleProcess):
    """`tandoor admission`."""

    def __init__(self, log_dir: Path, env: dict[str, str]) -> None:
        env = {"TANDOOR_ADMISSION_METRICS_PORT": "0", **env}
        super().__init__("admission", ["admission"], "admission ready", log_dir, env)


class StreamsProcess(RoleProcess):
    """`tandoor streams`; its HTTP port comes from TANDOOR_STREAMS_WEB_PORT."""

    def __init__(self, log_dir: Path, env: dict[str, str]) -> None:
        super().__init__("streams", ["streams"], "[^Worker]: Ready", log_dir, env)

    def ops_port(self) -> int:
        """Its web port serves /metrics, /health and /ready next to the rollups."""
        return int(self._env.get("TANDOOR_STREAMS_WEB_PORT", Settings().streams_web_port))


class IdleWorkerProcess(RoleProcess):
    """A member of the model's worker group that takes nothing (infra/idle_worker.py),
    in a process of its own like the real roles."""

    module = "infra.idle_worker"

    def __init__(self, model: str, log_dir: Path, env: dict[str, str]) -> None:
        super().__init__(f"idle-worker-{model}", [model], IDLE_READY, log_dir, env)


class GatewayProcess(RoleProcess):
    """`tandoor gateway --port P`."""

    def __init__(self, log_dir: Path, port: int, env: dict[str, str]) -> None:
        args = ["gateway", "--port", str(port)]
        env = {"TANDOOR_GATEWAY_METRICS_PORT": "0", **env}
        # Logged once it listens: uvicorn logs "Application startup complete" before it
        # binds the port, and then exits if the port is taken.
        super().__init__("gateway", args, "Uvicorn running on", log_dir, env)
        self.port = port


@asynccontextmanager
async def running(roles: Sequence[RoleProcess]) -> AsyncIterator[None]:
    """Start every role, wait until all are ready, and stop them all on the way out."""
    for role in roles:
        role.start()
    try:
        await asyncio.gather(*(role.wait_ready() for role in roles))
        yield
    finally:
        await terminate_all(roles)


async def terminate_all(roles: Sequence[RoleProcess], timeout_s: float = 120) -> list[int]:
    """SIGTERM every role at once and wait for them all: their drains overlap. A thread
    each: asyncio's default pool (cores + 4) told a seventh role only once one had ended.
    Their exit codes, in order."""
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(max_workers=max(1, len(roles))) as pool:
        waits = (loop.run_in_executor(pool, role.terminate, timeout_s) for role in roles)
        return list(await asyncio.gather(*waits))


async def model_alias(
    settings: Settings, model_dir: Path, prefix: str
) -> tuple[str, dict[str, str]]:
    """A fresh model name served from `model_dir`, with its prompt topic created, and the
    environment that makes roles serve it: isolated topics and groups per test or run."""
    (model, *_), env = await model_aliases(settings, model_dir, [prefix])
    return model, env


async def model_aliases(
    settings: Settings, model_dir: Path, prefixes: Sequence[str]
) -> tuple[list[str], dict[str, str]]:
    """Like model_alias, for several names served together (the first names the groups)."""
    models = [f"{prefix}-{uuid.uuid4().hex[:6]}" for prefix in prefixes]
    await _create_prompt_topics(settings, models)
    env = {
        "TANDOOR_MODELS": json.dumps({m: {"source": str(model_dir)} for m in models}),
        "TANDOOR_GATEWAY_GROUP": f"gateway-{models[0]}",
        "TANDOOR_PERSIST_GROUP": f"persist-{models[0]}",
        "TANDOOR_ADMISSION_GROUP": f"admission-{models[0]}",
    }
    # A new persist group would store all `tokens` still retains (earliest), which on a
    # machine that ran benchmarks is minutes of others' replies: it starts at the end;
    # so does admission, on `batch.requests`.
    await start_group_at_end(settings, env["TANDOOR_PERSIST_GROUP"])
    await start_group_at_end(settings, env["TANDOOR_ADMISSION_GROUP"], batch_request_partitions())
    return models, env


async def add_model(
    settings: Settings, env: dict[str, str], model_dir: Path, prefix: str, **options: object
) -> tuple[str, dict[str, str]]:
    """A fresh name for another model (`model_dir`), with its prompt topic created, added
    to the models `env` serves, each of `options` (ModelConfig fields) set."""
    model = f"{prefix}-{uuid.uuid4().hex[:6]}"
    await _create_prompt_topics(settings, [model])
    models = {**json.loads(env["TANDOOR_MODELS"]), model: {"source": str(model_dir), **options}}
    return model, {**env, "TANDOOR_MODELS": json.dumps(models)}


async def _create_prompt_topics(settings: Settings, models: Sequence[str]) -> None:
    partitions = sum(band.partitions for band in settings.bands)
    await ensure_topics(
        settings.kafka_bootstrap, [TopicSpec(prompts_topic(m), partitions) for m in models]
    )


def with_models(
    env: dict[str, str], only: Sequence[str] | None = None, **options: object
) -> dict[str, str]:
    """`env` whose TANDOOR_MODELS serves `only` those of its models (all by default), each
    with `options` (tandoor/models.py ModelConfig fields) set."""
    models = json.loads(env["TANDOOR_MODELS"])
    kept = {
        name: {**config, **options}
        for name, config in models.items()
        if only is None or name in only
    }
    return {**env, "TANDOOR_MODELS": json.dumps(kept)}
