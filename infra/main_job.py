"""The main job's life: servers, then roles, then a watch that ends on a stop signal or
on a role or server that dies; and a teardown that stops exactly what it started,
whatever ends it."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from infra.errors import InfraError
from infra.process import port_open
from infra.role_pids import RolePids
from infra.roles import RoleProcess, prune_role_logs, terminate_all
from tandoor.settings import Settings

# Ctrl-C, a closed terminal or SSH session, `kill`: without a handler SIGHUP ended the
# job before its teardown, leaving every role (a worker holds GBs) running unseen.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


# A role's exit code once asked to stop: its own 0, or SIGTERM re-raised (the gateway).
CLEAN = (0, -signal.SIGTERM)


class Stopped(Exception):
    """A stop signal arrived."""


class Servers(Protocol):
    def up(self) -> None: ...

    def down(self, started_only: bool = False) -> None: ...

    def gone(self) -> str | None:
        """What says a server has exited (its name and log), if one has."""


def check_free_to_run(settings: Settings, pids: RolePids) -> None:
    """Refused before anything starts: a second run with this home (it started every
    role again, a second worker per model joining the first run's groups) and a port
    another program holds (found when the gateway failed to bind, minutes later)."""
    if (job := pids.running_job()) is not None:
        raise InfraError(
            f"a `tandoor run` (pid {job}) is already running with {settings.home}: "
            "stop it first (Ctrl-C there, or `kill` it)"
        )
    ports = [
        (settings.gateway_port, "TANDOOR_GATEWAY_PORT"),
        (settings.streams_web_port, "TANDOOR_STREAMS_WEB_PORT"),
    ]
    for port, name in ports:
        if port_open(settings.host, port):
            raise InfraError(
                f"port {settings.host}:{port} ({name}) is taken by another process: "
                "stop it, or set another port"
            )


def run_main_job(
    servers: Servers,
    roles: Sequence[RoleProcess],
    prepare: Callable[[], None],
    announce: Callable[[], None],
    say: Callable[[str], None],
    poll_s: float = 1.0,
    pids: RolePids | None = None,
) -> int:
    """0 once stopped by a signal, 1 if a role or a server died, or a role did not stop
    cleanly. Servers someone else had running are left running: only those this job
    started are stopped. With `pids`, each role's pid is noted on disk, and roles a
    killed job left running are stopped first."""
    stop_on_signals()
    codes: list[int] = []
    try:
        for orphan in pids.stop_orphans() if pids else []:
            say(f"stopped {orphan}: left running by a job that was killed")
        with contextlib.suppress(OSError):  # a log left is no reason not to start
            prune_role_logs(roles, pids.running() if pids else set())
        servers.up()
        prepare()
        for role in roles:
            role.start()
            if pids:
                pids.note(role)
            say(f"{role.name} starting (log {role.log_file})")
        asyncio.run(_all_ready(roles, say))
        announce()
        say(f"error: {until_one_exits(roles, servers, poll_s)}")
        return 1
    except Stopped as stop:
        say(f"{stop}: stopping…")
    finally:
        ignore_stop_signals()  # a second Ctrl-C must not cut the teardown short
        try:
            codes = asyncio.run(terminate_all(roles))
            if pids:
                for role in roles:
                    pids.forget(role)
        finally:  # whatever a role did, the servers this job started are stopped
            servers.down(started_only=True)
    # Stopped by a signal: a role that failed on its way out (or was killed) says so.
    unclean = [f"{r.name} (code {c})" for r, c in zip(roles, codes, strict=True) if c not in CLEAN]
    if unclean:
        say(f"error: {', '.join(unclean)} did not stop cleanly")
    return 1 if unclean else 0


def stop_on_signals() -> None:
    """From now on a stop signal raises Stopped wherever the job is, its start included."""

    def stop(signum: int, _frame: object) -> None:
        ignore_stop_signals()
        raise Stopped(signal.Signals(signum).name)

    for sig in STOP_SIGNALS:
        signal.signal(sig, stop)


def ignore_stop_signals() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def until_one_exits(roles: Sequence[RoleProcess], servers: Servers, poll_s: float) -> str:
    """What exited first: a role (a worker out of memory, its engine dead) or a server
    (Kafka killed: every role then only retried, and the job looked up)."""
    while True:
        for role in roles:
            if not role.alive:
                return f"{role.name} exited (code {role.exit_code}); log {role.log_file}"
        if gone := servers.gone():
            return gone
        time.sleep(poll_s)


async def _all_ready(roles: Sequence[RoleProcess], say: Callable[[str], None]) -> None:
    await asyncio.gather(*(role.wait_ready() for role in roles))
    for role in roles:
        say(f"{role.name} ready (metrics {role.ops_url()})")
