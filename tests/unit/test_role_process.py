"""A role's process tree when its main process dies first (kill -9, the OOM killer): a
worker's vLLM engine core is its child, in its process group, and has no watch on its
parent. Stopping the role signalled the group only while the main process lived, so the
engine core ran on holding its memory, and the role's pid file was forgotten with it."""

from __future__ import annotations

import contextlib
import os
import re
import signal
from pathlib import Path

from infra.process import process_alive
from infra.roles import RoleProcess
from tests.waiting import until

LEADER_DIES = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
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
