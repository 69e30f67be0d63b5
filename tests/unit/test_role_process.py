"""A role's process tree when its main process dies first (kill -9, the OOM killer): a
worker's vLLM engine core is its child, in its process group, and has no watch on its
parent. Stopping the role signalled the group only while the main process lived, so the
engine core ran on holding its memory, and the role's pid file was forgotten with it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
from pathlib import Path

import pytest

from infra.process import process_alive
from infra.roles import RoleProcess, terminate_all
from tests.waiting import until

LEADER_DIES = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
print(f"child {child.pid}", flush=True)
print("toy ready", flush=True)
"""


async def test_stopping_a_role_whose_main_process_died_stops_its_children(
    tmp_path: Path,
) -> None:
    (tmp_path / "leader_dies.py").write_text(LEADER_DIES)
    role = RoleProcess("dying", [], "toy ready", tmp_path, {"PYTHONPATH": str(tmp_path)})
    role.module = "leader_dies"
    role.start()
    await role.wait_ready()
    await until(lambda: not role.alive, what="the main process exited")
    found = re.search(r"child (\d+)", role.log())
    assert found is not None, role.log()
    child = int(found.group(1))
    try:
        assert process_alive(child), "its child outlived it, as an engine core does"
        role.terminate(timeout_s=10)
        await until(lambda: not process_alive(child), what="the child stopped", idle_s=10)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


DRAINS_UNTIL_RELEASED = """
import signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})  # the release, waited for
def drain(*_):
    print("draining", flush=True)
    signal.sigwait({signal.SIGUSR1})
    sys.exit(0)
signal.signal(signal.SIGTERM, drain)
print("toy ready", flush=True)
while True:
    signal.pause()
"""


async def test_every_role_is_told_to_stop_at_once_however_many(tmp_path: Path) -> None:
    """Stopped through asyncio's default thread pool (cores + 4 threads: 6 on two cores),
    a seventh role got its SIGTERM only once another had drained (up to 120 s)."""
    many = min(32, (os.cpu_count() or 1) + 4) + 1
    (tmp_path / "drains.py").write_text(DRAINS_UNTIL_RELEASED)
    env = {"PYTHONPATH": str(tmp_path)}
    roles = [RoleProcess(f"r{n}", [], "toy ready", tmp_path, env) for n in range(many)]
    try:
        for role in roles:
            role.module = "drains"
            role.start()
        await asyncio.gather(*(role.wait_ready() for role in roles))
        stopping = asyncio.create_task(terminate_all(roles, timeout_s=60))
        await until(
            lambda: sum("draining" in role.log() for role in roles) == many,
            what="every role draining",
            idle_s=10,
        )
        for role in roles:  # released: each drain ends
            assert role.proc is not None
            role.proc.send_signal(signal.SIGUSR1)
        await stopping
    finally:
        for role in roles:
            role.kill()


async def test_a_role_killed_then_stopped_has_its_group_killed_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped after it was killed (a fault test's kill, then the stack's teardown), its
    group was killed again: by then its number may be another process group's."""
    (tmp_path / "leader_dies.py").write_text(LEADER_DIES)
    role = RoleProcess("killed", [], "toy ready", tmp_path, {"PYTHONPATH": str(tmp_path)})
    role.module = "leader_dies"
    role.start()
    await role.wait_ready()
    killed: list[int] = []
    real = os.killpg

    def killpg(group: int, sig: int) -> None:
        killed.append(group)
        real(group, sig)

    monkeypatch.setattr(os, "killpg", killpg)
    role.kill()
    role.terminate(timeout_s=10)
    assert role.proc is not None and killed == [role.proc.pid]


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "gateway-0.tandoor.svc", "::1"])
def test_the_ops_address_is_read_whatever_the_host_is_named(host: str, tmp_path: Path) -> None:
    """A dotted address alone was read: with TANDOOR_HOST=localhost `tandoor run` started
    every role, then failed saying the worker never logged its metrics address."""
    role = RoleProcess("worker", [], "ready", tmp_path, {})
    role.log_file.write_text(f"worker metrics on http://{host}:9400/metrics\n")
    assert role.ops_port() == 9400
    # As `tandoor run` prints it: where it listens (127.0.0.1 was printed for any host).
    assert role.ops_url() == f"http://{host}:9400/metrics"
