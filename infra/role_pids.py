"""The main job's roles on disk: a pid file each, naming the job that started it. Roles
whose job was killed (kill -9, the OOM killer) ran on in their own sessions, unseen:
the gateway's port taken, a worker's GBs held, and `infra down` knew of none. The next
`tandoor run`, and `infra down`, stop them."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from infra.process import process_alive, start_time, stop_group
from infra.roles import RoleProcess

STOP_GRACE_S = 30.0


@dataclass(frozen=True)
class NotedRole:
    name: str  # its log file's stem: unique per start
    pid: int
    started: int | None
    job: int
    job_started: int | None

    def line(self) -> str:
        return f"{self.pid} {self.started} {self.job} {self.job_started}"


def _running(pid: int, started: int | None) -> bool:
    """Still the process noted (after a reboot the pid may be another program's)."""
    return process_alive(pid) and start_time(pid) == started


class RolePids:
    def __init__(self, run_dir: Path) -> None:
        self.dir = run_dir / "roles"

    def note(self, role: RoleProcess) -> None:
        assert role.proc is not None, "noted once started"
        job = os.getpid()
        noted = NotedRole(
            role.log_file.stem, role.proc.pid, start_time(role.proc.pid), job, start_time(job)
        )
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / f"{noted.name}.pid").write_text(noted.line())

    def forget(self, role: RoleProcess) -> None:
        (self.dir / f"{role.log_file.stem}.pid").unlink(missing_ok=True)

    def noted(self) -> list[NotedRole]:
        found = []
        for path in sorted(self.dir.glob("*.pid")):
            try:
                pid, started, job, job_started = (_int(f) for f in path.read_text().split())
            except (FileNotFoundError, ValueError):
                continue  # being written, or not ours
            if pid is not None and job is not None:
                found.append(NotedRole(path.stem, pid, started, job, job_started))
        return found

    def running(self) -> set[str]:
        """The log stems of the noted roles still running (another job's)."""
        return {role.name for role in self.noted() if _running(role.pid, role.started)}

    def running_job(self) -> int | None:
        """The pid of another job still running whose roles are noted here, if any."""
        jobs = {(r.job, r.job_started) for r in self.noted() if r.job != os.getpid()}
        return next((job for job, started in sorted(jobs) if _running(job, started)), None)

    def stop_orphans(self) -> list[str]:
        """Stop the roles whose job is gone; those of a running job are left alone."""
        stopped = []
        for role in self.noted():
            if _running(role.job, role.job_started):
                continue
            if _running(role.pid, role.started):
                stop_group(role.pid, STOP_GRACE_S)  # its own session: the engine goes too
                stopped.append(role.name)
            (self.dir / f"{role.name}.pid").unlink(missing_ok=True)
        return stopped


def _int(field: str) -> int | None:
    return None if field == "None" else int(field)
